"""Which instance holds which block, in which tier, built from the instances' KV event streams.

    entries:  block key -> (instance slot, generation, tier)    one holder, count 1
                           | {(instance slot, generation, tier): count}
              in store order (a plain dict: a store takes its hash out and puts it back last)

A tier is an event's medium and locality as one label (`events.tier_of`): GPU, CPU,
STORAGE/LOCAL, STORAGE/REMOTE (vLLM 0.33's words; the older DISK and EXTERNAL read as the
STORAGE ones). Weights are per tier; a medium the router does not know counts
`UNKNOWN_TIER_WEIGHT`, with one warning naming it.

An instance is named once, when it is registered (`add_instance`; the router uses its URL), and
that one name is used by the index, the scorer, metrics and logs.

- Counts, not flags: one hash may be stored in several blocks and removed several times.
- Each instance's events are applied in its seq order (the subscriber guarantees it).
- Clearing an instance (AllBlocksCleared, a publisher restart, lost events) bumps its
  generation: O(1), old entries stop counting and are swept lazily.
- `STORAGE/REMOTE` blocks (a store shared by the instances, e.g. Redis) count for every
  instance.
- A cap on entries evicts the least recently stored hashes, 1/64 of the cap at a time
  (counted).

Per instance, the index learns from the stream (see `schemes.py`) its block size and its hash
scheme: the first `BlockStored` that starts a prefix and carries its tokens is checked against
the configured scheme and the known candidates. A match keys the instance's entries by its own
engine hashes. No match (a random or private seed, another algorithm) keys them by the
router's own chain over the events' token ids (engine hash -> router key), so routing still
works; events without tokens then resolve through that map or are counted as unresolvable. A
later prefix-starting event that contradicts the learned scheme is a HASH MISMATCH (counted,
logged once): the instance is cleared and learned anew.

A request is scored against each instance at that instance's block size and scheme: one hash
chain per distinct (scheme, block size), shared by the instances that have it.

Single-threaded: the router serialises `apply_*` and `score` itself.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, KeysView, Sequence
from dataclasses import dataclass, field
from itertools import islice

from kvconnect.events import (
    MEDIUM_STORAGE,
    TIER_CPU,
    TIER_GPU,
    TIER_STORAGE_LOCAL,
    TIER_STORAGE_REMOTE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEventBatch,
    tier_of,
)
from kvconnect.hashing import DEFAULT_ALGORITHM
from kvconnect.router.schemes import (
    ChainMemo,
    HashScheme,
    RouterKeys,
    candidate_schemes,
    checkable,
    first_block_matches,
)
from kvconnect.stream.subscriber import (
    EventsLost,
    PublisherRestarted,
    ReceivedBatch,
    StreamSnapshot,
    SubscriberItem,
)

logger = logging.getLogger(__name__)

DEFAULT_TIER_WEIGHTS = {
    TIER_GPU: 1.0,
    TIER_CPU: 0.8,
    TIER_STORAGE_LOCAL: 0.5,
    TIER_STORAGE_REMOTE: 0.3,
    MEDIUM_STORAGE: 0.3,  # STORAGE with no locality: it may be either
}
UNKNOWN_TIER_WEIGHT = 0.1
"""A tier no weight names: some credit (it holds the block somewhere), less than any known."""

Key = tuple[int, int, str]  # (instance slot, generation, tier)
EVICT_CHUNK = 64
"""Past `max_entries`, the index evicts down to max_entries - max_entries // EVICT_CHUNK."""


@dataclass
class PrefixScore:
    """What one instance can serve of a request's prefix."""

    num_blocks: int = 0
    """Consecutive prefix blocks available in some tier."""
    weighted: float = 0.0
    """The same blocks weighted by their best tier."""
    blocks_per_tier: dict[str, int] = field(default_factory=dict)
    block_size: int = 0
    """The instance's block size (0: not known yet)."""

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def weighted_tokens(self) -> float:
        """Prefill tokens this instance saves, weighted by tier."""
        return self.weighted * self.block_size


@dataclass
class _Instance:
    name: str
    slot: int
    generation: int = 0
    stale: bool = False
    block_size: int | None = None
    scheme: HashScheme | None = None
    """The engine's own scheme, once an event has shown it."""
    router_keys: RouterKeys | None = None
    """Set when no known scheme reproduces its events: entries are keyed by the router."""
    hash_mismatches: int = 0
    keys: dict[str, Key] = field(default_factory=dict)
    """Per tier, the holder key of its entries (`BlockIndex._key`)."""
    num_blocks: int = 0
    """Blocks announced and not taken back, all media (a clear resets it): how much it
    holds, which breaks ties between instances equally good for a request."""

    @property
    def scheme_name(self) -> str:
        if self.router_keys is not None:
            return f"router-keyed:{self.router_keys.scheme}"
        return "unknown" if self.scheme is None else str(self.scheme)


@dataclass
class IndexStats:
    events_applied: int = 0
    batches_applied: int = 0
    clears: int = 0
    restarts: int = 0
    gaps_lost: int = 0
    snapshots: int = 0
    entries_evicted: int = 0
    unmatched_removals: int = 0
    hash_mismatches: int = 0
    removed: Counter[str] = field(default_factory=Counter)
    """Entries taken back by BlockRemoved events, per tier."""
    stale: Counter[str] = field(default_factory=Counter)
    """Entries found stale by a load miss (`mark_stale`), per tier: what an instance lost
    without an event saying so."""


class BlockIndex:
    def __init__(
        self,
        block_size: int = 16,
        *,
        hash_algorithm: str = DEFAULT_ALGORITHM,
        hash_seed: str | None = None,
        hash_candidates: Sequence[HashScheme] | None = None,
        max_entries: int = 1_000_000,
        tier_weights: dict[str, float] | None = None,
        external_shared: bool = True,
        memo_blocks: int = 200_000,
    ) -> None:
        """`block_size` and the scheme (`hash_algorithm`, `hash_seed`; None is vLLM's rule)
        are what the router assumes until an instance's events say otherwise; the scheme also
        keys instances whose own hashes no candidate reproduces. `memo_blocks` bounds the
        memo of request block hashes (`schemes.ChainMemo`)."""
        self.block_size = block_size
        self.scheme = HashScheme.resolve(hash_algorithm, hash_seed)
        self.candidates = (
            list(hash_candidates) if hash_candidates is not None else candidate_schemes(self.scheme)
        )
        self.max_entries = max_entries
        self.tier_weights = dict(DEFAULT_TIER_WEIGHTS if tier_weights is None else tier_weights)
        """Per tier label; `None` keys are not allowed (see `tier_of`)."""
        self._warned_tiers: set[str] = set()
        self.external_shared = external_shared
        self.instances: dict[str, _Instance] = {}
        self._by_slot: list[_Instance] = []
        # One holder with count 1 (most blocks) is its key alone: no dict per entry.
        # A plain dict in store order (a store moves its key to the end): an OrderedDict's
        # links and node table cost 60-80 bytes an entry more (bench/replicas.py).
        self._entries: dict[ExternalBlockHash, Key | dict[Key, int]] = {}
        self.stats = IndexStats()
        self.memo = ChainMemo(memo_blocks)

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

    def num_blocks(self) -> dict[str, int]:
        """Per instance, the blocks it holds as its stream says (see `_Instance.num_blocks`)."""
        return {name: inst.num_blocks for name, inst in self.instances.items()}

    def schemes(self) -> dict[str, tuple[str, int | None]]:
        """Per instance: the hash scheme learned from its stream, and its block size."""
        return {name: (i.scheme_name, i.block_size) for name, i in self.instances.items()}

    # -- applying events ------------------------------------------------------------------------

    def apply_item(self, instance: str, item: SubscriberItem) -> None:
        """Apply what a `KVEventSubscriber` yielded for `instance`'s stream."""
        if isinstance(item, ReceivedBatch):
            self.apply_batch(instance, item.batch)
        elif isinstance(item, PublisherRestarted):
            # A new engine process: its seed (and so its scheme) may be new too.
            self.stats.restarts += 1
            self.clear_instance(instance, relearn=True)
        elif isinstance(item, EventsLost):
            # Missed removals could make old entries lie: drop them; fresh events rebuild (or
            # the snapshot that follows, from a kvconnect publisher).
            self.stats.gaps_lost += 1
            self.clear_instance(instance)
            self._instance(instance).stale = True
        elif isinstance(item, StreamSnapshot):
            # The instance's whole state as of a seq: what it held before no longer counts.
            self.stats.snapshots += 1
            self.clear_instance(instance)
            self.apply_batch(instance, item.batch)
            self._instance(instance).stale = False

    def apply_batch(self, instance: str, batch: KVEventBatch) -> None:
        """The hot path: a pop and an insert per block, no allocation per existing entry."""
        inst = self._instance(instance)
        stats = self.stats
        stats.batches_applied += 1
        stats.events_applied += len(batch.events)
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._apply_stored(inst, event)
            elif isinstance(event, BlockRemoved):
                self._apply_removed(inst, event)
            elif isinstance(event, AllBlocksCleared):
                self.clear_instance(instance)
                inst.stale = False  # a full clear is a resync point

    def _apply_stored(self, inst: _Instance, event: BlockStored) -> None:
        if event.parent_block_hash is None and inst.router_keys is None:
            self._check_scheme(inst, event)
        keys = event.block_hashes
        if inst.router_keys is not None:
            keys = inst.router_keys.store(event)
        entries, by_slot = self._entries, self._by_slot
        pop = entries.pop
        tier = tier_of(event.medium, event.locality)
        if tier not in self.tier_weights:
            self._unknown_tier(tier)
        key = self._key(inst, tier)
        inst.num_blocks += len(keys)
        for h in keys:
            holders = pop(h, None)  # stored again: back in at the end (the newest)
            if holders is None:
                entries[h] = key
            elif type(holders) is dict:
                holders[key] = holders.get(key, 0) + 1
                entries[h] = holders
            elif holders == key:
                entries[h] = {key: 2}
            elif by_slot[holders[0]].generation != holders[1]:  # type: ignore[index]
                entries[h] = key  # the one holder was of an old generation
            else:
                entries[h] = {holders: 1, key: 1}  # type: ignore[dict-item]
        if len(entries) > self.max_entries:
            self._evict_oldest()

    @staticmethod
    def _key(inst: _Instance, tier: str) -> Key:
        """The holder key of `inst`'s blocks in `tier`, one tuple per (instance, generation,
        tier) shared by all its entries (a tuple per event cost ~6 bytes an entry)."""
        key = inst.keys.get(tier)
        if key is None or key[1] != inst.generation:
            key = inst.keys[tier] = (inst.slot, inst.generation, tier)
        return key

    def _evict_oldest(self) -> None:
        """Past the cap, the least recently stored entries go, down to 1/EVICT_CHUNK below it:
        a dict finds its oldest key by skipping the holes its deletions left at its front
        (until it is resized), so evicting one at a time would cost one such pass each."""
        entries = self._entries
        num = len(entries) - self.max_entries + self.max_entries // EVICT_CHUNK
        for h in list(islice(entries, num)):
            del entries[h]
        self.stats.entries_evicted += num

    def _unknown_tier(self, tier: str) -> None:
        """A tier no weight names: credited `UNKNOWN_TIER_WEIGHT`, said once per tier."""
        if tier not in self._warned_tiers and len(self._warned_tiers) < 64:
            self._warned_tiers.add(tier)
            logger.warning(
                "router: events name tier %r, which no --tier-weights entry names; "
                "crediting it %.2f (known: %s)",
                tier,
                UNKNOWN_TIER_WEIGHT,
                ", ".join(sorted(self.tier_weights)),
            )

    def _apply_removed(self, inst: _Instance, event: BlockRemoved) -> None:
        tier = tier_of(event.medium, event.locality)
        key = self._key(inst, tier)
        entries, stats, router_keys = self._entries, self.stats, inst.router_keys
        removed = 0
        for h in event.block_hashes:
            mapped = h if router_keys is None else router_keys.remove(h)
            if mapped is None:
                continue
            holders = entries.get(mapped)
            if type(holders) is tuple:
                if holders == key:
                    del entries[mapped]
                    removed += 1
                else:
                    stats.unmatched_removals += 1
                continue
            count = None if holders is None else holders.get(key)  # type: ignore[union-attr]
            if holders is None or count is None:
                stats.unmatched_removals += 1
            elif count > 1:
                holders[key] = count - 1  # type: ignore[index]
                removed += 1
            else:
                del holders[key]  # type: ignore[union-attr]
                removed += 1
                self._sweep(mapped, holders)  # type: ignore[arg-type]
        if removed:
            stats.removed[tier] += removed
            inst.num_blocks -= removed

    def _sweep(self, h: ExternalBlockHash, holders: dict[Key, int]) -> None:
        """Drop holders of old generations; the entry itself when nobody is left, its one
        holder's key when one with count 1 is."""
        by_slot = self._by_slot
        for key in [k for k in holders if by_slot[k[0]].generation != k[1]]:
            del holders[key]
        if not holders:
            del self._entries[h]
        elif len(holders) == 1:
            ((key, count),) = holders.items()
            if count == 1:
                self._entries[h] = key

    def _holders(self, h: ExternalBlockHash) -> dict[Key, int]:
        """The holders of `h` as a dict (a copy for a single holder; not the hot path)."""
        holders = self._entries.get(h)
        if holders is None:
            return {}
        return dict(holders) if type(holders) is dict else {holders: 1}  # type: ignore[dict-item]

    def clear_instance(self, instance: str, relearn: bool = False) -> None:
        """Forget everything `instance` announced (O(1): its generation moves on); with
        `relearn`, also its block size and hash scheme."""
        inst = self._instance(instance)
        inst.generation += 1
        inst.num_blocks = 0
        if inst.router_keys is not None:
            inst.router_keys.clear()
        if relearn:
            inst.scheme, inst.router_keys, inst.block_size = None, None, None
        self.stats.clears += 1

    # -- learning an instance's scheme -----------------------------------------------------------

    def _check_scheme(self, inst: _Instance, event: BlockStored) -> None:
        """Learn the instance's scheme from a prefix-starting event, or check it against it."""
        keys = checkable(event)
        if keys is None:
            return
        if inst.scheme is not None and inst.block_size == event.block_size:
            if first_block_matches(event, keys, inst.scheme):
                return
            self._mismatch(inst, event)
        inst.block_size = event.block_size
        inst.scheme = next(
            (s for s in self.candidates if first_block_matches(event, keys, s)), None
        )
        if inst.scheme is not None:
            logger.info(
                "router: %s hashes blocks with %s at block size %d",
                inst.name,
                inst.scheme,
                inst.block_size,
            )
            return
        # Nothing reproduces its hashes: key its blocks by the router's own chain. What it
        # announced before (keyed by its own hashes) cannot be translated: start over.
        self.clear_instance(inst.name)
        inst.router_keys = RouterKeys(self.scheme, self.max_entries)
        logger.warning(
            "router: no known hash scheme reproduces %s's block hashes (a random or private "
            "seed, or another algorithm); keying it by the router's own %s chain over its "
            "events' token ids",
            inst.name,
            self.scheme,
        )

    def _mismatch(self, inst: _Instance, event: BlockStored) -> None:
        inst.hash_mismatches += 1
        self.stats.hash_mismatches += 1
        if inst.hash_mismatches == 1:
            logger.error(
                "HASH MISMATCH from %s: a prefix-starting event's hashes contradict its own "
                "token ids under the scheme learned from its stream (%s, block size %s); "
                "forgetting its entries and learning its scheme again",
                inst.name,
                inst.scheme,
                inst.block_size,
            )
        self.clear_instance(inst.name)

    # -- lookups ----------------------------------------------------------------------------

    def request_hashes(
        self,
        token_ids: Sequence[int],
        block_size: int | None = None,
        scheme: HashScheme | None = None,
        cache_salt: str | None = None,
    ) -> list[ExternalBlockHash]:
        """The wire hashes of a request's full blocks (the router's defaults unless given)."""
        return (scheme or self.scheme).wire_hashes(
            token_ids, block_size or self.block_size, cache_salt=cache_salt
        )

    def score(
        self, token_ids: Sequence[int], cache_salt: str | None = None
    ) -> dict[str, PrefixScore]:
        """Per instance, what it holds of the request's prefix, hashed its own way."""
        groups: dict[tuple[HashScheme, int], list[int]] = {}
        for inst in self._by_slot:
            if inst.block_size is None:
                continue  # nothing announced with tokens yet: nothing to match
            rk = inst.router_keys
            scheme = rk.scheme if rk is not None else inst.scheme or self.scheme
            groups.setdefault((scheme, inst.block_size), []).append(inst.slot)
        out = {inst.name: PrefixScore() for inst in self._by_slot}
        for (scheme, bs), slots in groups.items():
            # Hashed lazily (and from the memo where the prefix was seen): scoring stops at the
            # first block no instance holds, and so does hashing.
            hashes = scheme.iter_wire_hashes(token_ids, bs, self.memo, cache_salt)
            for slot, score in self._score_slots(hashes, slots).items():
                score.block_size = bs
                out[self._by_slot[slot].name] = score
        return out

    def score_hashes(self, hashes: Sequence[ExternalBlockHash]) -> dict[str, PrefixScore]:
        """Per instance, against one chain of hashes (instances hashing alike)."""
        scores = self._score_slots(hashes, range(len(self._by_slot)))
        for slot, score in scores.items():
            score.block_size = self._by_slot[slot].block_size or self.block_size
        return {self._by_slot[slot].name: score for slot, score in scores.items()}

    def _score_slots(
        self, hashes: Iterable[ExternalBlockHash], slots: Sequence[int]
    ) -> dict[int, PrefixScore]:
        """For these instance slots: the longest run of consecutive prefix blocks each can
        serve, each block weighted by the best tier it is in there. Consecutive blocks with
        the same holders (the common case: a prefix several instances hold) are counted as one
        run, so a long shared prefix costs a lookup and a key comparison per block."""
        by_slot = self._by_slot
        gens = [inst.generation for inst in by_slot]
        weights, shared_tier = self.tier_weights, self.external_shared
        entries = self._entries
        counts = dict.fromkeys(slots, 0)
        weighted = dict.fromkeys(slots, 0.0)
        tiers: dict[int, dict[str, int]] = {s: {} for s in slots}
        alive = list(slots)
        run = 0  # blocks in the current run of identical holders
        run_best: dict[int, tuple[float, str]] = {}
        prev: Key | dict[Key, int] | None = None
        prev_keys: KeysView[Key] | None = None
        for h in hashes:
            holders = entries.get(h)
            if not holders:
                break
            if holders is prev or (
                prev_keys is not None and type(holders) is dict and holders.keys() == prev_keys
            ):
                run += 1
                continue
            self._credit(run_best, run, counts, weighted, tiers)
            best: dict[int, tuple[float, str]] = {}
            shared: tuple[float, str] | None = None
            keys: Iterable[Key] = (holders,) if type(holders) is tuple else holders  # type: ignore[assignment]
            for slot, gen, tier in keys:
                if gens[slot] != gen:
                    continue
                w = (weights.get(tier, UNKNOWN_TIER_WEIGHT), tier)
                if tier == TIER_STORAGE_REMOTE and shared_tier:
                    if shared is None or w > shared:
                        shared = w
                elif slot not in best or w > best[slot]:
                    best[slot] = w
            run_best = {}
            for slot in alive:
                b = best.get(slot)
                if shared is not None and (b is None or shared > b):
                    b = shared
                if b is not None:
                    run_best[slot] = b
            alive = list(run_best)
            if not alive:
                break
            run, prev = 1, holders
            prev_keys = holders.keys() if type(holders) is dict else None
        self._credit(run_best, run, counts, weighted, tiers)
        return {s: PrefixScore(counts[s], weighted[s], tiers[s]) for s in slots}

    @staticmethod
    def _credit(
        run_best: dict[int, tuple[float, str]],
        run: int,
        counts: dict[int, int],
        weighted: dict[int, float],
        tiers: dict[int, dict[str, int]],
    ) -> None:
        """Credit each slot of a run of `run` blocks with its tier in that run."""
        if not run:
            return
        for slot, (w, tier) in run_best.items():
            counts[slot] += run
            weighted[slot] += w * run
            tiers[slot][tier] = tiers[slot].get(tier, 0) + run

    def mark_stale(
        self,
        instance: str,
        token_ids: Sequence[int],
        num_cached_tokens: int,
        cache_salt: str | None = None,
    ) -> int:
        """`instance` answered a request computing only `num_cached_tokens` of its prompt from
        cache, fewer than the index credited it with: the credited blocks after those are not
        there (a load miss; an eviction nobody announced). Drop its entries for them, and the
        shared (STORAGE/REMOTE) ones, since a miss there means the store lost them. The prompt's
        last token is always computed, so its block is never counted against the instance.
        Returns the entries dropped."""
        inst = self.instances.get(instance)
        if inst is None or inst.block_size is None:
            return 0
        rk = inst.router_keys
        scheme = rk.scheme if rk is not None else inst.scheme or self.scheme
        bs = inst.block_size
        hashes = scheme.wire_hashes(token_ids, bs, cache_salt=cache_salt)
        usable = min(len(hashes), max(0, len(token_ids) - 1) // bs)
        credited = self._score_slots(hashes[:usable], [inst.slot])[inst.slot].num_blocks
        dropped = 0
        gens = [i.generation for i in self._by_slot]
        for h in hashes[num_cached_tokens // bs : credited]:
            if h not in self._entries:
                continue
            holders = self._entries[h] = self._holders(h)
            for key in list(holders):
                slot, gen, tier = key
                mine = slot == inst.slot
                if gens[slot] == gen and (
                    mine or (tier == TIER_STORAGE_REMOTE and self.external_shared)
                ):
                    del holders[key]
                    self.stats.stale[tier] += 1
                    dropped += 1
            self._sweep(h, holders)
        return dropped

    def blocks_of(
        self, instance: str, medium: str, locality: str | None = None
    ) -> set[ExternalBlockHash]:
        """Every block `instance` announced in (`medium`, `locality`) and has not taken back
        (O(entries): for tests and inspection, not the hot path)."""
        inst = self.instances.get(instance)
        if inst is None:
            return set()
        key = (inst.slot, inst.generation, tier_of(medium, locality))
        return {h for h in self._entries if key in self._holders(h)}

    def holders(self, h: ExternalBlockHash) -> dict[str, set[str]]:
        """The instances holding `h` and in which tiers (their own, not shared ones)."""
        out: dict[str, set[str]] = {}
        for slot, gen, tier in self._holders(h):
            inst = self._by_slot[slot]
            if inst.generation == gen:
                out.setdefault(inst.name, set()).add(tier)
        return out

    def check_integrity(self) -> None:
        """AssertionError unless counts are positive and every holder names a known slot."""
        for h in self._entries:
            holders = self._holders(h)
            assert holders, f"empty entry {h!r}"
            for (slot, gen, _), count in holders.items():
                assert 0 <= slot < len(self._by_slot), "unknown instance slot"
                assert count > 0, "non-positive count"
                assert gen <= self._by_slot[slot].generation, "future generation"
        assert len(self._entries) <= self.max_entries, "over the entry cap"
        for inst in self._by_slot:
            if inst.router_keys is not None:
                inst.router_keys.check_integrity()
