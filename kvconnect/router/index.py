"""Which instance holds which block, in which tier, built from the instances' KV event streams.

    entries:  block hash -> {(instance slot, generation, medium): count}     (LRU ordered)

An instance is named once, when it is registered (`add_instance`; the router uses its URL), and
that one name is used by the index, the scorer, metrics and logs.

- Counts, not flags: one hash may be stored in several blocks and removed several times.
- Each instance's events are applied in its seq order (the subscriber guarantees it).
- Clearing an instance (AllBlocksCleared, a publisher restart, lost events) bumps its
  generation: O(1), old entries stop counting and are swept lazily.
- `EXTERNAL` blocks (a store shared by the instances, e.g. Redis) count for every instance.
- A cap on entries evicts the least recently stored hashes (counted).
- `BlockStored` events that start a prefix (no parent) are re-hashed with the router's own
  settings; a mismatch means the router and that engine disagree on the seed, algorithm or
  block size, so prefix routing cannot work: it is counted and logged loudly.

Single-threaded: the router serialises `apply_*` and `score` itself.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvconnect.events import (
    MEDIUM_EXTERNAL,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEventBatch,
)
from kvconnect.hashing import DEFAULT_ALGORITHM, block_hashes, to_wire
from kvconnect.subscriber import EventsLost, PublisherRestarted, ReceivedBatch, SubscriberItem

logger = logging.getLogger(__name__)

DEFAULT_TIER_WEIGHTS = {"GPU": 1.0, "CPU": 0.8, "DISK": 0.5, "EXTERNAL": 0.3}


@dataclass
class PrefixScore:
    """What one instance can serve of a request's prefix."""

    num_blocks: int = 0
    """Consecutive prefix blocks available in some tier."""
    weighted: float = 0.0
    """The same blocks weighted by their best tier."""
    blocks_per_tier: dict[str, int] = field(default_factory=dict)


@dataclass
class _Instance:
    name: str
    slot: int
    generation: int = 0
    stale: bool = False
    hash_mismatches: int = 0


@dataclass
class IndexStats:
    events_applied: int = 0
    batches_applied: int = 0
    clears: int = 0
    restarts: int = 0
    gaps_lost: int = 0
    entries_evicted: int = 0
    unmatched_removals: int = 0
    hash_mismatches: int = 0


class BlockIndex:
    def __init__(
        self,
        block_size: int = 16,
        *,
        hash_algorithm: str = DEFAULT_ALGORITHM,
        hash_seed: str | None = None,
        max_entries: int = 1_000_000,
        tier_weights: dict[str, float] | None = None,
        external_shared: bool = True,
    ) -> None:
        self.block_size = block_size
        self.hash_algorithm, self.hash_seed = hash_algorithm, hash_seed
        self.max_entries = max_entries
        self.tier_weights = dict(DEFAULT_TIER_WEIGHTS if tier_weights is None else tier_weights)
        self.external_shared = external_shared
        self.instances: dict[str, _Instance] = {}
        self._by_slot: list[_Instance] = []
        self._entries: OrderedDict[ExternalBlockHash, dict[tuple[int, int, str], int]] = (
            OrderedDict()
        )
        self.stats = IndexStats()

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def add_instance(self, name: str) -> None:
        """Register an instance under `name` (idempotent); events name it from then on."""
        if name not in self.instances:
            inst = self.instances[name] = _Instance(name, len(self._by_slot))
            self._by_slot.append(inst)

    def _instance(self, name: str) -> _Instance:
        inst = self.instances.get(name)
        if inst is None:
            self.add_instance(name)
            inst = self.instances[name]
        return inst

    # -- applying events ------------------------------------------------------------------------

    def apply_item(self, instance: str, item: SubscriberItem) -> None:
        """Apply what a `KVEventSubscriber` yielded for `instance`'s stream."""
        if isinstance(item, ReceivedBatch):
            self.apply_batch(instance, item.batch)
        elif isinstance(item, PublisherRestarted):
            self.stats.restarts += 1
            self.clear_instance(instance)
        elif isinstance(item, EventsLost):
            # Missed removals could make old entries lie: drop them; fresh events rebuild.
            self.stats.gaps_lost += 1
            self.clear_instance(instance)
            self._instance(instance).stale = True

    def apply_batch(self, instance: str, batch: KVEventBatch) -> None:
        inst = self._instance(instance)
        self.stats.batches_applied += 1
        for event in batch.events:
            self.stats.events_applied += 1
            if isinstance(event, BlockStored):
                self._check_hashes(inst, event)
                self._store(event.block_hashes, (inst.slot, inst.generation, event.medium or "GPU"))
            elif isinstance(event, BlockRemoved):
                key_medium = event.medium or "GPU"
                for h in event.block_hashes:
                    self._remove(h, (inst.slot, inst.generation, key_medium))
            elif isinstance(event, AllBlocksCleared):
                self.clear_instance(instance)
                inst.stale = False  # a full clear is a resync point

    def _store(self, hashes: list[ExternalBlockHash], key: tuple[int, int, str]) -> None:
        """The hot path of `apply_batch`: count `key` once more for each hash."""
        entries = self._entries
        for h in hashes:
            holders = entries.get(h)
            if holders is None:
                entries[h] = {key: 1}
                if len(entries) > self.max_entries:
                    entries.popitem(last=False)
                    self.stats.entries_evicted += 1
            else:
                entries.move_to_end(h)
                holders[key] = holders.get(key, 0) + 1

    def _remove(self, h: ExternalBlockHash, key: tuple[int, int, str]) -> None:
        """Count `key` once less for `h`; a removal nothing matches is counted, not an error."""
        holders = self._entries.get(h)
        count = holders.get(key) if holders is not None else None
        if holders is None or count is None:
            self.stats.unmatched_removals += 1
            return
        if count > 1:
            holders[key] = count - 1
        else:
            del holders[key]
            self._sweep(h, holders)

    def _sweep(self, h: ExternalBlockHash, holders: dict[tuple[int, int, str], int]) -> None:
        """Drop holders of old generations; the entry itself when nobody is left."""
        by_slot = self._by_slot
        for key in [k for k in holders if by_slot[k[0]].generation != k[1]]:
            del holders[key]
        if not holders:
            del self._entries[h]

    def clear_instance(self, instance: str) -> None:
        """Forget everything `instance` announced (O(1): its generation moves on)."""
        self._instance(instance).generation += 1
        self.stats.clears += 1

    def _check_hashes(self, inst: _Instance, event: BlockStored) -> None:
        if event.parent_block_hash is not None or not event.token_ids:
            return
        if len(event.token_ids) != event.block_size * len(event.block_hashes):
            return
        if event.block_size != self.block_size:
            mine: list[ExternalBlockHash] = []
        else:
            raw = block_hashes(
                event.token_ids,
                self.block_size,
                algorithm=self.hash_algorithm,
                seed=self.hash_seed,
                extra_keys=event.extra_keys,
            )
            mine = [to_wire(h, as_int=isinstance(event.block_hashes[0], int)) for h in raw]
        if mine != list(event.block_hashes):
            inst.hash_mismatches += 1
            self.stats.hash_mismatches += 1
            if inst.hash_mismatches == 1:
                logger.error(
                    "HASH MISMATCH from %s: its block hashes differ from the router's "
                    "(block_size %d vs %d, algorithm %s, seed %r). Prefix routing to this "
                    "instance cannot work until the settings agree.",
                    inst.name,
                    event.block_size,
                    self.block_size,
                    self.hash_algorithm,
                    self.hash_seed,
                )

    # -- lookups ----------------------------------------------------------------------------

    def request_hashes(self, token_ids: Sequence[int]) -> list[ExternalBlockHash]:
        """The wire hashes of a request's full blocks, as the engines compute them."""
        raw = block_hashes(
            token_ids, self.block_size, algorithm=self.hash_algorithm, seed=self.hash_seed
        )
        return [to_wire(h) for h in raw]

    def score(self, token_ids: Sequence[int]) -> dict[str, PrefixScore]:
        return self.score_hashes(self.request_hashes(token_ids))

    def score_hashes(self, hashes: Sequence[ExternalBlockHash]) -> dict[str, PrefixScore]:
        """Per instance: the longest run of consecutive prefix blocks it can serve, each block
        weighted by the best tier it is in there."""
        by_slot = self._by_slot
        gens = [inst.generation for inst in by_slot]
        weights, shared_tier = self.tier_weights, self.external_shared
        counts = [0] * len(by_slot)
        weighted = [0.0] * len(by_slot)
        tiers: list[dict[str, int]] = [{} for _ in by_slot]
        alive = list(range(len(by_slot)))
        for h in hashes:
            holders = self._entries.get(h)
            if not holders or not alive:
                break
            best: dict[int, tuple[float, str]] = {}
            shared: tuple[float, str] | None = None
            for slot, gen, medium in holders:
                if gens[slot] != gen:
                    continue
                w = (weights.get(medium, 0.0), medium)
                if medium == MEDIUM_EXTERNAL and shared_tier:
                    if shared is None or w > shared:
                        shared = w
                elif slot not in best or w > best[slot]:
                    best[slot] = w
            still = []
            for slot in alive:
                b = best.get(slot)
                if shared is not None and (b is None or shared > b):
                    b = shared
                if b is None:
                    continue
                still.append(slot)
                counts[slot] += 1
                weighted[slot] += b[0]
                tiers[slot][b[1]] = tiers[slot].get(b[1], 0) + 1
            alive = still
        return {
            inst.name: PrefixScore(counts[s], weighted[s], tiers[s])
            for s, inst in enumerate(by_slot)
        }

    def holders(self, h: ExternalBlockHash) -> dict[str, set[str]]:
        """The instances holding `h` and in which media (their own, not shared ones)."""
        out: dict[str, set[str]] = {}
        for (slot, gen, medium), _ in (self._entries.get(h) or {}).items():
            inst = self._by_slot[slot]
            if inst.generation == gen:
                out.setdefault(inst.name, set()).add(medium)
        return out

    def check_integrity(self) -> None:
        """AssertionError unless counts are positive and every holder names a known slot."""
        for h, holders in self._entries.items():
            assert holders, f"empty entry {h!r}"
            for (slot, gen, _), count in holders.items():
                assert 0 <= slot < len(self._by_slot), "unknown instance slot"
                assert count > 0, "non-positive count"
                assert gen <= self._by_slot[slot].generation, "future generation"
        assert len(self._entries) <= self.max_entries, "over the entry cap"
