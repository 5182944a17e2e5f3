"""Blocks per request on top of the `BlockPool`: prefix-cache lookup, allocation, freeing.

A request's blocks cover its computed tokens plus the ones scheduled this step:

    blocks   [ b0 | b1 | b2 | b3 ]            block_size = 4
    tokens   [xxxx|xxxx|xx..|....]            10 computed (or being computed)
    cached    b0, b1 are full: in the prefix cache once their tokens are computed
"""

from __future__ import annotations

from kvconnect.engine.block_pool import BlockPool, KVCacheBlock
from kvconnect.engine.request import Request


class KVCacheManager:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self._blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of `request` (blocks, tokens). At least one token is left
        to compute, so that the step produces logits. A request asking for prompt logprobs
        reads nothing: they need every prompt position's logits (as in vLLM)."""
        if not self.pool.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for h in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, [])]

    def holds_blocks(self, request_id: str) -> bool:
        return bool(self._blocks.get(request_id))

    def num_blocks_needed(self, request: Request, num_tokens: int, num_hits: int = 0) -> int:
        """New blocks needed for `request` to hold `num_tokens` tokens."""
        have = len(self._blocks.get(request.request_id, ())) + num_hits
        return max(0, -(-num_tokens // self.block_size) - have)

    def allocate_slots(
        self,
        request: Request,
        num_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[int] | None:
        """Make `request` hold `num_tokens` tokens (computed + new), taking `new_computed_blocks`
        (prefix-cache hits) first. None, with nothing changed, if blocks are short."""
        hits = new_computed_blocks or []
        need = self.num_blocks_needed(request, num_tokens, len(hits))
        # Hits that sit in the free queue leave it when touched: count them as used too.
        free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if need + free_hits > self.pool.num_free_blocks:
            return None
        blocks = self._blocks.setdefault(request.request_id, [])
        if hits:
            self.pool.touch(hits)
            blocks.extend(hits)
            self._num_cached_blocks[request.request_id] = len(blocks)
        blocks.extend(self.pool.get_new_blocks(need))
        return [b.block_id for b in blocks]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Enter the request's blocks made full by `num_computed_tokens` in the prefix cache."""
        blocks = self._blocks.get(request.request_id)
        if not blocks:
            return
        num_full = min(num_computed_tokens // self.block_size, len(request.block_hashes))
        num_cached = self._num_cached_blocks.get(request.request_id, 0)
        if num_full > num_cached:
            self.pool.cache_full_blocks(
                blocks,
                request.block_hashes,
                request.all_token_ids,
                num_cached,
                num_full,
                request.event_extra_keys,
            )
            self._num_cached_blocks[request.request_id] = num_full

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first so that its prefix is evicted last."""
        blocks = self._blocks.pop(request_id, [])
        self._num_cached_blocks.pop(request_id, None)
        self.pool.free_blocks(list(reversed(blocks)))

    def truncate_computed(self, request: Request, first_bad_block: int) -> None:
        """Blocks from `first_bad_block` on must be recomputed: forget that they are cached."""
        cached = self._num_cached_blocks.get(request.request_id, 0)
        self._num_cached_blocks[request.request_id] = min(cached, first_bad_block)

    @property
    def num_requests(self) -> int:
        return len(self._blocks)
