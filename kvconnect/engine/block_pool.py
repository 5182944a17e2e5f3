"""The pool of KV cache blocks: reference counts, an LRU free queue and the prefix cache.

A block is in exactly one of two states:
    in use     ref_cnt > 0, not in the free queue
    free       ref_cnt == 0, in the free queue (oldest first); it may still be cached, i.e.
               hold a full block whose hash is in the prefix cache, until it is reused

    cache_full_blocks  block gets a hash, enters the cache      -> BlockStored (one per run)
    get_new_blocks     a free cached block is reused: evicted    -> BlockRemoved (one per block)
    reset_prefix_cache all blocks free: cache emptied            -> AllBlocksCleared

Events are shaped as vLLM's: medium "GPU", group 0 ("full_attention": one kind of attention
layer), and on BlockStored the run's token ids and one extra-keys entry per block.

The same hash may be cached in several blocks (two requests computed the same prefix at once);
as in vLLM each copy gets its own events, so consumers count per hash.
Events are buffered here and drained by the scheduler once per step (`take_events`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvconnect.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from kvconnect.hashing import ExtraKeys, to_wire

GROUP_IDX = 0
SPEC_KIND = "full_attention"


class KVCacheBlock:
    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        cached = self.block_hash is not None
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, cached={cached})"


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks!r}: must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, dict[int, KVCacheBlock]] = {}
        self._events: list[KVCacheEvent] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        copies = self._cached.get(block_hash)
        return next(iter(copies.values())) if copies else None

    def cached_hashes(self) -> dict[bytes, int]:
        """Each cached hash and how many blocks hold it."""
        return {h: len(copies) for h, copies in self._cached.items()}

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the prefix cache."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` free blocks, least recently freed first, evicting cached ones."""
        if num_blocks > len(self._free):
            raise ValueError(f"asked for {num_blocks} blocks, {len(self._free)} are free")
        out = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        h = block.block_hash
        if h is None:
            return
        copies = self._cached[h]
        del copies[block.block_id]
        if not copies:
            del self._cached[h]
        block.block_hash = None
        if self.enable_kv_cache_events:
            self._events.append(BlockRemoved([to_wire(h)], MEDIUM_GPU, group_idx=GROUP_IDX))

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop blocks from the prefix cache (their contents are bad, e.g. a failed load)."""
        for block_id in block_ids:
            self._evict(self.blocks[block_id])

    def free_blocks(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Release references; blocks reaching 0 join the free queue in the given order
        (pass a request's blocks tail first so that its prefix is evicted last)."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[bytes],
        token_ids: Sequence[int],
        num_cached_blocks: int,
        num_full_blocks: int,
        event_extra_keys: Callable[[int], ExtraKeys | None] = lambda _: None,
    ) -> None:
        """Enter blocks[num_cached_blocks:num_full_blocks] of a request in the prefix cache.
        `event_extra_keys(i)` is block i's extra keys as events carry them."""
        if not self.enable_caching or num_cached_blocks >= num_full_blocks:
            return
        new_hashes = []
        extra_keys: list[ExtraKeys | None] = []
        for i in range(num_cached_blocks, num_full_blocks):
            block, h = blocks[i], block_hashes[i]
            if block.block_hash is not None:  # already cached (a prefix-cache hit)
                continue
            block.block_hash = h
            self._cached.setdefault(h, {})[block.block_id] = block
            new_hashes.append(h)
            extra_keys.append(event_extra_keys(i))
        if self.enable_kv_cache_events and new_hashes:
            bs = self.block_size
            parent = to_wire(block_hashes[num_cached_blocks - 1]) if num_cached_blocks else None
            self._events.append(
                BlockStored(
                    block_hashes=[to_wire(h) for h in new_hashes],
                    parent_block_hash=parent,
                    token_ids=list(token_ids[num_cached_blocks * bs : num_full_blocks * bs]),
                    block_size=bs,
                    lora_id=None,
                    medium=MEDIUM_GPU,
                    lora_name=None,
                    extra_keys=extra_keys,
                    group_idx=GROUP_IDX,
                    kv_cache_spec_kind=SPEC_KIND,
                )
            )

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; only possible when no block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        if self.enable_kv_cache_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def check_integrity(self) -> None:
        """AssertionError if ref counts, the free queue and the cache disagree."""
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"{block} has a negative ref count"
            assert (block.ref_cnt == 0) == (block.block_id in self._free), f"{block} misfiled"
            if block.block_hash is not None:
                assert self._cached[block.block_hash].get(block.block_id) is block, block
        for h, copies in self._cached.items():
            assert copies, "empty cache entry"
            assert all(b.block_hash == h for b in copies.values()), "cache entry hash mismatch"
