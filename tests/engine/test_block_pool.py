import pytest

from kvconnect.engine.block_pool import BlockPool
from kvconnect.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvconnect.hashing import block_hashes, to_wire

BS = 4
TOKENS = list(range(100, 116))  # 4 full blocks
HASHES = block_hashes(TOKENS, BS)


def pool(n: int = 8, events: bool = True) -> BlockPool:
    return BlockPool(n, BS, enable_caching=True, enable_kv_cache_events=events)


def stored(hashes: list[bytes], parent: bytes | None, tokens: list[int]) -> BlockStored:
    """What vLLM's block pool publishes for a run of newly cached blocks."""
    return BlockStored(
        [to_wire(h) for h in hashes],
        None if parent is None else to_wire(parent),
        tokens,
        BS,
        None,
        "GPU",
        None,
        extra_keys=[None] * len(hashes),
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )


def removed(h: bytes) -> BlockRemoved:
    return BlockRemoved([to_wire(h)], "GPU", group_idx=0)


def test_new_blocks_come_from_the_front_of_the_free_queue() -> None:
    p = pool()
    blocks = p.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks) and p.num_free_blocks == 5
    p.free_blocks(list(reversed(blocks)))  # tail first
    assert [b.block_id for b in p.get_new_blocks(8)] == [3, 4, 5, 6, 7, 2, 1, 0]
    with pytest.raises(ValueError, match="asked for 1 blocks, 0 are free"):
        p.get_new_blocks(1)
    p.check_integrity()


def test_caching_a_run_queues_one_block_stored_with_parent_and_tokens() -> None:
    p = pool()
    blocks = p.get_new_blocks(4)
    p.cache_full_blocks(blocks, HASHES, TOKENS, 0, 2)
    p.cache_full_blocks(blocks, HASHES, TOKENS, 2, 4)
    assert p.take_events() == [
        stored(HASHES[:2], None, TOKENS[:8]),
        stored(HASHES[2:], HASHES[1], TOKENS[8:]),
    ]
    assert p.take_events() == []
    assert p.get_cached_block(HASHES[2]) is blocks[2]
    p.check_integrity()


def test_reusing_a_free_cached_block_evicts_it_with_block_removed() -> None:
    p = pool(4)
    blocks = p.get_new_blocks(4)
    p.cache_full_blocks(blocks, HASHES, TOKENS, 0, 4)
    p.take_events()
    p.free_blocks(list(reversed(blocks)))  # the tail block is evicted first
    assert p.get_cached_block(HASHES[0]) is blocks[0]  # free blocks stay cached
    p.get_new_blocks(2)
    assert p.take_events() == [
        removed(HASHES[3]),
        removed(HASHES[2]),
    ]
    assert p.cached_hashes() == {HASHES[0]: 1, HASHES[1]: 1}
    p.check_integrity()


def test_touching_a_cached_free_block_takes_it_out_of_the_free_queue() -> None:
    p = pool(4)
    blocks = p.get_new_blocks(2)
    p.cache_full_blocks(blocks, HASHES, TOKENS, 0, 2)
    p.free_blocks(blocks)
    hit = p.get_cached_block(HASHES[0])
    assert hit is not None
    p.touch([hit])
    assert hit.ref_cnt == 1 and p.num_free_blocks == 3
    p.touch([hit])
    assert hit.ref_cnt == 2
    p.check_integrity()


def test_one_hash_in_two_blocks_gets_events_for_each() -> None:
    p = pool(4)
    a, b = p.get_new_blocks(1), p.get_new_blocks(1)
    p.cache_full_blocks(a, HASHES, TOKENS, 0, 1)
    p.cache_full_blocks(b, HASHES, TOKENS, 0, 1)
    assert len(p.take_events()) == 2 and p.cached_hashes() == {HASHES[0]: 2}
    p.free_blocks(a + b)
    p.get_new_blocks(4)
    assert p.take_events() == [removed(HASHES[0])] * 2
    assert p.cached_hashes() == {}
    p.check_integrity()


def test_reset_needs_every_block_free_then_clears_with_one_event() -> None:
    p = pool(4)
    blocks = p.get_new_blocks(2)
    p.cache_full_blocks(blocks, HASHES, TOKENS, 0, 2)
    p.take_events()
    assert p.reset_prefix_cache() is False and p.take_events() == []
    p.free_blocks(blocks)
    assert p.reset_prefix_cache() is True
    assert p.take_events() == [AllBlocksCleared()]
    assert p.cached_hashes() == {} and p.get_cached_block(HASHES[0]) is None
    p.check_integrity()


def test_evict_blocks_after_a_failed_load() -> None:
    p = pool(4)
    blocks = p.get_new_blocks(2)
    p.cache_full_blocks(blocks, HASHES, TOKENS, 0, 2)
    p.take_events()
    p.evict_blocks([blocks[1].block_id])
    assert p.take_events() == [removed(HASHES[1])]
    assert p.get_cached_block(HASHES[1]) is None
    p.check_integrity()


def test_events_off_and_caching_off() -> None:
    p = pool(4, events=False)
    blocks = p.get_new_blocks(1)
    p.cache_full_blocks(blocks, HASHES, TOKENS, 0, 1)
    assert p.take_events() == [] and p.get_cached_block(HASHES[0]) is blocks[0]
    off = BlockPool(4, BS, enable_caching=False, enable_kv_cache_events=True)
    off.cache_full_blocks(off.get_new_blocks(1), HASHES, TOKENS, 0, 1)
    assert off.take_events() == [] and off.cached_hashes() == {}


def test_events_carry_each_blocks_extra_keys_as_vllm_publishes_them() -> None:
    p = pool()
    blocks = p.get_new_blocks(2)
    salted = block_hashes(TOKENS[:8], BS, cache_salt="tenant")
    p.cache_full_blocks(blocks, salted, TOKENS, 0, 2, lambda i: ("tenant",) if i == 0 else None)
    (event,) = p.take_events()
    assert isinstance(event, BlockStored) and event.extra_keys == [("tenant",), None]
    p.check_integrity()
