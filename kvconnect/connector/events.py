"""KV cache events of worker-side connectors, carried in worker metadata, released by quorum.

Worker side: each rank puts the events of its step into `KVEventsWorkerMetadata.from_rank(rank,
events)` (alone, or as a field of the connector's own metadata). `aggregate` keeps each rank's
events under its rank, so the fold is associative and order-independent and the scheduler knows
who said what.

Scheduler side: `EventQuorum.update(meta)` once per step (meta may be None), `take_events()`
when the scheduler collects events. An event is released once `required_ranks` distinct ranks
reported it (the world size by default; fewer where only some ranks hold a block), even when
they report in different steps. A rank that reports the same event twice counts twice only for
two occurrences of it (stored, removed, stored again), never as two ranks. Occurrences still
short of quorum after `max_pending_steps` steps are dropped, counted in `num_expired` and logged.

Ranks must report bit-identical events (same hashes, same medium string) for them to meet;
the quorum compares their msgpack encodings.

    step 1: rank0 [S(a)]        rank1 []              -> nothing    pending a: {0:1}
    step 2: rank0 []            rank1 [S(a), R(b)]    -> S(a)       pending b: {1:1}
    step 3: rank0 [R(b)]                              -> R(b)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import msgspec

from kvconnect.events import KVCacheEvent
from kvconnect.messages import KVConnectorWorkerMetadata

logger = logging.getLogger(__name__)

_encode = msgspec.msgpack.Encoder().encode


@dataclass
class KVEventsWorkerMetadata(KVConnectorWorkerMetadata):
    """The KV cache events of one step, per reporting rank."""

    events_by_rank: dict[int, list[KVCacheEvent]] = field(default_factory=dict)

    @classmethod
    def from_rank(cls, rank: int, events: Iterable[KVCacheEvent]) -> KVEventsWorkerMetadata:
        return cls({rank: list(events)})

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVEventsWorkerMetadata:
        if not isinstance(other, KVEventsWorkerMetadata):
            raise TypeError(f"cannot aggregate KVEventsWorkerMetadata with {type(other).__name__}")
        merged = {rank: list(events) for rank, events in self.events_by_rank.items()}
        for rank, events in other.events_by_rank.items():
            merged.setdefault(rank, []).extend(events)
        return replace(self, events_by_rank=merged)  # a subclass keeps its type and fields

    @property
    def num_events(self) -> int:
        return sum(len(events) for events in self.events_by_rank.values())


@dataclass(slots=True)
class _Pending:
    event: KVCacheEvent
    counts: dict[int, int]  # rank -> occurrences reported
    released: int  # occurrences already released
    since_step: int  # step of the oldest unreleased occurrence


class EventQuorum:
    """Releases an event once the required number of distinct ranks reported it."""

    def __init__(
        self, world_size: int, required_ranks: int | None = None, max_pending_steps: int = 64
    ) -> None:
        required = world_size if required_ranks is None else required_ranks
        if not 1 <= required <= world_size:
            raise ValueError(f"required_ranks={required_ranks!r}: must be in [1, {world_size}]")
        if max_pending_steps < 1:
            raise ValueError(f"max_pending_steps={max_pending_steps!r}: must be >= 1")
        self.world_size = world_size
        self.required_ranks = required
        self.max_pending_steps = max_pending_steps
        self._step = 0
        self._pending: dict[bytes, _Pending] = {}
        self._ready: list[KVCacheEvent] = []
        self.num_released = 0
        self.num_expired = 0

    @property
    def num_pending(self) -> int:
        """Events reported by some ranks and still short of quorum."""
        return len(self._pending)

    def update(self, meta: KVEventsWorkerMetadata | None) -> None:
        """Take one step's aggregated reports (None: no rank reported events this step)."""
        self._step += 1
        if meta is not None:
            by_rank = meta.events_by_rank
            for rank in by_rank:
                if not 0 <= rank < self.world_size:
                    raise ValueError(f"events from rank {rank}; world size is {self.world_size}")
            if not self._release_unanimous(by_rank):
                for rank in sorted(by_rank):
                    for event in by_rank[rank]:
                        self._add(rank, event)
        self._expire()

    def _release_unanimous(self, by_rank: dict[int, list[KVCacheEvent]]) -> bool:
        """The common TP case, fast: nothing is pending and at least `required_ranks` ranks
        reported the same events in the same order this step, so all of them are complete."""
        if self._pending or len(by_rank) < self.required_ranks:
            return False
        reports = list(by_rank.values())
        first = reports[0]
        keys = [_encode(e) for e in first]
        for other in reports[1:]:
            if len(other) != len(first) or [_encode(e) for e in other] != keys:
                return False
        self._ready.extend(first)
        self.num_released += len(first)
        return True

    def _add(self, rank: int, event: KVCacheEvent) -> None:
        key = _encode(event)
        entry = self._pending.get(key)
        if entry is None:
            entry = self._pending[key] = _Pending(event, {}, 0, self._step)
        entry.counts[rank] = entry.counts.get(rank, 0) + 1
        if len(entry.counts) < self.required_ranks:
            return
        # An occurrence is complete when `required_ranks` ranks have reported it: the
        # required_ranks-th largest per-rank count is the number of complete occurrences.
        if len(entry.counts) == self.required_ranks:
            complete = min(entry.counts.values())
        else:
            complete = sorted(entry.counts.values(), reverse=True)[self.required_ranks - 1]
        for _ in range(complete - entry.released):
            self._ready.append(entry.event)
        self.num_released += complete - entry.released
        entry.released = complete
        if all(n == complete for n in entry.counts.values()):
            del self._pending[key]
        else:
            entry.since_step = self._step

    def _expire(self) -> None:
        oldest = self._step - self.max_pending_steps
        stale = [k for k, e in self._pending.items() if e.since_step <= oldest]
        for key in stale:
            entry = self._pending.pop(key)
            lost = max(entry.counts.values()) - entry.released
            self.num_expired += lost
            logger.warning(
                "KV event quorum: dropped %d occurrence(s) of %s reported by ranks %s only "
                "(%d of %d required) for %d steps",
                lost,
                type(entry.event).__name__,
                sorted(entry.counts),
                len(entry.counts),
                self.required_ranks,
                self.max_pending_steps,
            )

    def take_events(self) -> list[KVCacheEvent]:
        """Events released since the last call, in release order."""
        ready, self._ready = self._ready, []
        return ready

    def check_integrity(self) -> None:
        """Raise AssertionError if the pending table is inconsistent."""
        for key, entry in self._pending.items():
            assert key == _encode(entry.event), "pending key does not match its event"
            assert entry.counts, "pending entry without reports"
            assert max(entry.counts.values()) > entry.released, "fully released entry kept"
            assert all(0 <= r < self.world_size for r in entry.counts), "rank out of range"
            assert entry.since_step > self._step - self.max_pending_steps, "stale entry kept"
