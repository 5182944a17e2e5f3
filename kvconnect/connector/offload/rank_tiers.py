"""A worker rank's tiers, in lookup order, and what the worker's threads do with them: the I/O
thread (stores, loads, resets), the pull threads (pulled chunks kept), the step thread (loads
from the cpu tier), the peer server's threads (reads for other instances).

    tiers = RankTiers(configs, placement, report)     the tiers made; what they held announced
    tiers.store(key, info, data, whole)    into the first local tier and every shared one
    tiers.put(index, key, info, data)      into one, what it evicts demoted to the next local
    tiers.fetch(key, info, use) -> bool    from the first that holds it, `use`d under its lock
    tiers.reserve(key) / commit(...) / unreserve(slot)   a cpu slot a pull receives into
    tiers.read(key, mac) / held_prefix(keys)             for a peer
    tiers.reset(); tiers.close()

Locks. Each local tier has its own (an RLock), held for every call into it but `contains`, and
for as long as anyone copies out of its memory (`fetch` runs `use` under it: a cpu slot read is
never overwritten meanwhile); a shared tier is called without one (a round trip must not hold
up a peer). What every call finds and does is reported in `report`: its events and counters.

What a tier returns must be the chunk asked for: its entry's token ids, parent hash, block
hashes and block size equal the scheduler's, its data has this rank's chunk shape and dtype
(`tiers.base.mismatch`; a key names only the last block's hash, and a shared tier holds what
anyone wrote). An entry that is not, or fails its signature, is a miss like an absent one,
counted in `num_integrity_misses`; a local tier drops it and announces its BlockRemoved (as it
does a corrupt entry), a shared one is not ours to change: this rank forgets it wrote it, so
the next save of the chunk writes it again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvconnect.connector.offload.common import (
    ChunkInfo,
    TierConfig,
    removed_event,
    stored_event,
)
from kvconnect.connector.offload.tiers import TierPlacement, create_tier
from kvconnect.connector.offload.tiers.base import (
    Evicted,
    IntegrityError,
    StoredChunk,
    Tier,
    TierError,
    TierTooSmall,
    TierUnavailable,
    mismatch,
    pack,
)
from kvconnect.connector.offload.tiers.cpu import CpuTier
from kvconnect.events import KVCacheEvent

logger = logging.getLogger(__name__)


class Report:
    """What a worker rank reports with each step: its events and its counters since the last
    one. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[KVCacheEvent] = []
        self._stats: dict[str, int] = {}

    def emit(self, *events: KVCacheEvent) -> None:
        with self._lock:
            self._events.extend(events)

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._stats[name] = self._stats.get(name, 0) + n

    def take_events(self) -> list[KVCacheEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def take_stats(self) -> dict[str, int]:
        with self._lock:
            stats, self._stats = self._stats, {}
        return stats


class RankTiers:
    def __init__(
        self, configs: Sequence[TierConfig], placement: TierPlacement, report: Report
    ) -> None:
        self.placement, self.report = placement, report
        self.tiers: list[Tier] = []
        for t in configs:
            try:
                self.tiers.append(create_tier(t, placement))
            except TierTooSmall as e:  # the chunk size is known only here, with the cache
                logger.warning("offload: %s; running without that tier", e)
        self.local = [i for i, t in enumerate(self.tiers) if not t.shared]
        """Indices of the local tiers (cpu, disk), in order."""
        self._locks: list[contextlib.AbstractContextManager[Any]] = [
            contextlib.nullcontext() if t.shared else threading.RLock() for t in self.tiers
        ]
        self.written_shared: set[str] = set()
        """Keys this rank put in shared tiers (under `_shared_lock`)."""
        self._shared_lock = threading.Lock()
        first = self.tiers[self.local[0]] if self.local else None
        self.cpu = first if isinstance(first, CpuTier) else None
        """The first local tier when it is a cpu tier: pulls receive into its slots."""
        for i, tier in enumerate(self.tiers):
            if isinstance(tier, CpuTier):
                # What it evicts is demoted to a local tier below it, or dropped: then its
                # data is not copied out (a fresh 12 MB per eviction, and its page faults).
                tier.keep_evicted = any(j > i for j in self.local)
        for tier in self.tiers:
            for _, info in tier.entries():  # found again after a restart
                report.emit(stored_event(info, tier.kind))

    def guard(self, index: int) -> contextlib.AbstractContextManager[Any]:
        """What a call into tier `index` holds."""
        return self._locks[index]

    def cpu_tier(self) -> int | None:
        """The index of the first cpu tier (where sync loads come from), if any."""
        return next((i for i in self.local if isinstance(self.tiers[i], CpuTier)), None)

    def contains_locally(self, key: str) -> bool:
        return any(self.tiers[i].contains(key) for i in self.local)

    def only_shared(self) -> bool:
        return all(t.shared for t in self.tiers)

    # -- stores -------------------------------------------------------------------------------

    def store(self, key: str, info: ChunkInfo, data: torch.Tensor, whole: bool) -> None:
        """Into the first local tier, and every shared one if the chunk is `whole` (a tail,
        fewer blocks than a chunk, stays local: only this instance looks for one)."""
        if self.local:
            self.put(self.local[0], key, info, data)
        for i, tier in enumerate(self.tiers):
            if tier.shared and whole:
                self.put(i, key, info, data)

    def put(self, index: int, key: str, info: ChunkInfo, data: torch.Tensor) -> None:
        """Put into tier `index`, demoting what it evicts to the next local tier."""
        tier = self.tiers[index]
        # A shared tier is written through: asking it first cost a round trip (and, with the
        # server hung, a timeout) whose answer was not used.
        try:
            with self.guard(index):
                if not tier.shared and tier.contains(key):
                    return
                evicted = tier.put(key, info, data)
        except TierError as e:
            self.failed(tier, e)
            return
        self.report.emit(stored_event(info, tier.kind))
        self.report.count(f"{tier.kind}_bytes_stored", data.numel() * data.element_size())
        if tier.shared:
            with self._shared_lock:
                self.written_shared.add(key)
        self.evicted(index, evicted)

    def evicted(self, index: int, evicted: list[Evicted]) -> None:
        """Announce what tier `index` evicted, and demote it to the next local tier."""
        tier = self.tiers[index]
        below = next(
            (j for j in range(index + 1, len(self.tiers)) if not self.tiers[j].shared), None
        )
        for ev in evicted:
            self.report.emit(removed_event(ev.info.block_hashes, tier.kind))
            self.report.count(f"num_{tier.kind}_evictions")
            if below is not None and ev.data is not None:
                self.put(below, ev.key, ev.info, ev.data)

    def forget_shared(self, keys: Sequence[str]) -> None:
        """A shared tier dropped these: the next save of each writes it again."""
        with self._shared_lock:
            self.written_shared.difference_update(keys)

    def written(self, key: str) -> bool:
        with self._shared_lock:
            return key in self.written_shared

    # -- loads --------------------------------------------------------------------------------

    def fetch(self, key: str, info: ChunkInfo, use: Callable[[torch.Tensor], None]) -> bool:
        """Chunk `key` from the first tier that holds it, `use`d while its tier's lock is held;
        a hit below the first local tier moves up. Whether any tier held it."""
        for i in range(len(self.tiers)):
            if self.fetch_from(i, key, info, use):
                return True
        logger.warning("offload: chunk %s found in no tier", key)
        return False

    def fetch_from(
        self, index: int, key: str, info: ChunkInfo, use: Callable[[torch.Tensor], None]
    ) -> bool:
        local, tier = self.local, self.tiers[index]
        promoted = None
        with self.guard(index):
            found = self.checked(index, key, info)
            if found is None:
                return False
            data = found.data
            use(data)
            if local and index != local[0]:  # a hit further down moves up
                promoted = data.clone()
        self.report.count(f"{tier.kind}_hits")
        self.report.count(f"{tier.kind}_bytes_loaded", data.numel() * data.element_size())
        if promoted is not None:
            self.put(local[0], key, info, promoted)
        return True

    def checked(self, index: int, key: str, info: ChunkInfo) -> StoredChunk | None:
        """Tier `index`'s entry for `key` if it is the chunk `info` describes; None otherwise
        (absent, unreadable, or another chunk: then dropped from a local tier and
        announced)."""
        tier = self.tiers[index]
        try:
            with self.guard(index):
                found = tier.load(key)
        except IntegrityError as e:
            self._integrity_miss(index, key, info, str(e), dropped=True)
            return None
        except TierError as e:
            self.failed(tier, e)
            if not tier.shared:  # the bad entry is gone from the tier
                self.report.emit(removed_event(info.block_hashes, tier.kind))
            return None
        if found is None:
            return None
        why = mismatch(info, found, self.placement)
        if why is None:
            return found
        self._integrity_miss(index, key, info, f"chunk {key}: {why}", dropped=False)
        return None

    def failed(self, tier: Tier, e: TierError) -> None:
        """Count a failed put or load in `num_<kind>_errors`, and a fast failure (the tier
        backing off, nothing tried) also in `num_<kind>_fast_failures`: logged only at debug
        level, as the tier logged the failure that started the back-off."""
        fast = isinstance(e, TierUnavailable)
        logger.log(logging.DEBUG if fast else logging.WARNING, "offload: %s", e)
        self.report.count(f"num_{tier.kind}_errors")
        if fast:
            self.report.count(f"num_{tier.kind}_fast_failures")

    def _integrity_miss(
        self, index: int, key: str, info: ChunkInfo, why: str, dropped: bool
    ) -> None:
        """An entry that is not the chunk asked for: a miss, counted and logged; a local tier
        loses it (announced: BlockRemoved of what it had announced), a shared tier is only
        written again by this rank's next save of the chunk."""
        tier = self.tiers[index]
        logger.warning("offload: %s tier: integrity miss: %s", tier.kind, why)
        self.report.count("num_integrity_misses")
        self.report.count(f"num_{tier.kind}_integrity_misses")
        if tier.shared:
            self.forget_shared([key])
            return
        with self.guard(index):
            held = info if dropped else tier.remove(key)
        if held is not None:
            self.report.emit(removed_event(held.block_hashes, tier.kind))

    # -- pulls: a cpu slot received into ------------------------------------------------------

    def reserve(self, key: str, n: int) -> tuple[int, memoryview] | None:
        """A slot of the first local tier, when that is a cpu tier and `n` fills a slot, for
        chunk `key` to be received into (evicting as a put would); None otherwise."""
        cpu = self.cpu
        if cpu is None or n != cpu.slot_bytes:
            return None
        index = self.local[0]
        with self.guard(index):
            got = cpu.reserve(key)
        if got is None:
            return None
        slot, view, evicted = got
        self.evicted(index, evicted)
        return slot, view

    def commit(self, slot: int, key: str, info: ChunkInfo, data: torch.Tensor) -> None:
        """The checked chunk in reserved `slot` is now the tier's: announced, counted."""
        assert self.cpu is not None
        try:
            with self.guard(self.local[0]):
                self.cpu.commit(slot, key, info)
        except TierError as e:
            self.failed(self.cpu, e)
            return
        self.report.emit(stored_event(info, self.cpu.kind))
        self.report.count(f"{self.cpu.kind}_bytes_stored", data.numel() * data.element_size())

    def unreserve(self, slot: int) -> None:
        assert self.cpu is not None
        with self.guard(self.local[0]):
            self.cpu.unreserve(slot)

    # -- for peers (the peer server's threads) ------------------------------------------------

    def held_prefix(self, keys: list[str]) -> int:
        """How many of `keys`, from the first, a local tier holds (`contains` may be called
        from any thread)."""
        local = [self.tiers[i] for i in self.local]
        num = 0
        while num < len(keys) and any(t.contains(keys[num]) for t in local):
            num += 1
        return num

    def read(self, key: str, mac_key: bytes | None) -> list[Any] | None:
        """Chunk `key` serialised, `pack`'s parts, or None if no local tier holds it. The
        payload is a view of the tier's own memory (sent without a copy), its checksum taken
        under the tier's lock, so no store writes the slot meanwhile. Should a later store
        reuse a cpu slot while its bytes are still being sent, the peer receives bytes that
        do not match that checksum (or signature) and refuses the chunk: a recompute, never
        wrong KV."""
        for i in self.local:
            with self.guard(i):
                try:
                    found = self.tiers[i].load(key)
                except TierError:
                    continue
                if found is not None:
                    self.report.count("peer_chunks_served")
                    return list(pack(key, found.info, found.data, mac_key))
        return None

    # -- the whole set ------------------------------------------------------------------------

    def reset(self) -> None:
        """Empty the local tiers, announcing exactly what each dropped (a shared tier is not
        ours to empty), so a router keeps what the engine itself still holds."""
        for i, tier in enumerate(self.tiers):
            with self.guard(i):
                dropped = tier.clear()
            self.report.emit(*(removed_event(info.block_hashes, tier.kind) for _, info in dropped))

    def close(self) -> None:
        """Close every tier, once no read is in flight (each local tier's lock taken)."""
        with contextlib.ExitStack() as held:
            for lock in self._locks:
                held.enter_context(lock)
            for tier in self.tiers:
                tier.close()
