"""The router's memo of request block hashes: a memoised chain is the fresh chain, for every
algorithm, seed, salt and block size, whatever was seen before and however small the memo."""

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from kvconnect.events import BlockStored, KVEventBatch
from kvconnect.hashing import ALGORITHMS
from kvconnect.router.index import BlockIndex
from kvconnect.router.schemes import ChainMemo, HashScheme

tokens = st.lists(st.integers(0, 2**31), min_size=0, max_size=200)


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(ALGORITHMS),
    st.sampled_from(["0", "vllm-none-hash", "private"]),
    st.sampled_from([1, 4, 16]),
    st.lists(st.tuples(tokens, st.sampled_from([None, "", "tenant-a", "tenant-b"])), max_size=8),
    st.sampled_from([0, 3, 1000]),
)
def test_a_memoised_chain_equals_a_fresh_one(
    algorithm: str, seed: str, bs: int, requests: list, max_blocks: int
) -> None:
    scheme = HashScheme(algorithm, seed)
    memo = ChainMemo(max_blocks)
    shared = list(range(40))  # prefixes that requests share, so the memo is hit
    for own, salt in requests:
        for prompt in (shared + own, own, shared):
            fresh = scheme.wire_hashes(prompt, bs, cache_salt=salt)
            assert list(scheme.iter_wire_hashes(prompt, bs, memo, salt)) == fresh
        assert len(memo) <= max_blocks
    if max_blocks >= 1000 and requests:
        assert memo.num_hits > 0


def test_schemes_and_salts_never_share_memo_entries() -> None:
    memo = ChainMemo()
    prompt = list(range(64))
    seen = {}
    for algorithm, salt in itertools.product(ALGORITHMS, [None, "a"]):
        scheme = HashScheme(algorithm, "0")
        got = list(scheme.iter_wire_hashes(prompt, 16, memo, salt))
        assert got == scheme.wire_hashes(prompt, 16, cache_salt=salt)
        seen[(algorithm, salt)] = got
    assert len({tuple(v) for v in seen.values()}) == len(seen)
    # Token ids beyond 64 bits hash exactly too.
    scheme = HashScheme("sha256", "0")
    big = [2**70] * 16
    assert list(scheme.iter_wire_hashes(big, 16, memo)) == scheme.wire_hashes(big, 16)


def test_scoring_hashes_only_up_to_the_first_block_no_instance_holds() -> None:
    index = BlockIndex(block_size=16)
    index.add_instance("a")
    prompt = list(range(16 * 100))
    held = index.request_hashes(prompt)[:10]
    index.apply_batch(
        "a",
        KVEventBatch(0.0, [BlockStored(held, None, prompt[:160], 16, None, "GPU", None)]),
    )
    before = index.memo.num_misses
    score = index.score(prompt)["a"]
    assert score.num_blocks == 10
    assert index.memo.num_misses - before == 11  # ten held blocks and the first unheld one
    before = index.memo.num_misses
    assert index.score(prompt + [5] * 16)["a"].num_blocks == 10  # the prefix from the memo
    assert index.memo.num_misses == before and index.memo.num_hits == 11  # nothing hashed


def test_long_prompts_through_whole_segments_and_partial_ones() -> None:
    """Seen prefixes ending inside and at the edge of 64-block segments, then extended."""
    scheme = HashScheme("sha256", "vllm-none-hash")
    memo = ChainMemo(10_000)
    doc = list(range(100, 100 + 16 * 300))  # 300 blocks: 4 whole segments and a tail
    for cut in (16 * 64, 16 * 100, 16 * 128, 16 * 300, 16 * 64 + 5, 0):
        fresh = scheme.wire_hashes(doc[:cut] + [7] * 40, 16)
        assert list(scheme.iter_wire_hashes(doc[:cut] + [7] * 40, 16, memo)) == fresh
        assert list(scheme.iter_wire_hashes(doc, 16, memo)) == scheme.wire_hashes(doc, 16)
    assert len(memo.segments) >= 4
    misses = memo.num_misses
    assert list(scheme.iter_wire_hashes(doc, 16, memo)) == scheme.wire_hashes(doc, 16)
    assert memo.num_misses == misses  # all from the memo, segments first
