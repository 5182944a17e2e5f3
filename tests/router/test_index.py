import logging
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconnect.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvconnect.hashing import block_hashes, to_wire
from kvconnect.router.index import BlockIndex
from kvconnect.subscriber import EventsLost, PublisherRestarted, ReceivedBatch, StreamId

A, B = "http://a:1", "http://b:1"
BS = 4
TOKENS = list(range(1, 25))  # 6 blocks
HASHES = [to_wire(h) for h in block_hashes(TOKENS, BS)]


def stored(
    hashes: list[int], medium: str = "GPU", tokens: list[int] | None = None, parent: int | None = 1
) -> BlockStored:
    return BlockStored(hashes, parent, tokens or [], BS, None, medium, None)


def batch(*events: object) -> KVEventBatch:
    return KVEventBatch(0.0, list(events), 0)  # type: ignore[arg-type]


def test_longest_consecutive_prefix_per_instance_with_tier_weights() -> None:
    idx = BlockIndex(BS)
    idx.apply_batch(A, batch(stored(HASHES[:4], "GPU")))
    idx.apply_batch(B, batch(stored(HASHES[:2], "GPU"), stored(HASHES[2:6], "CPU")))
    idx.apply_batch(A, batch(stored(HASHES[5:6], "GPU")))  # a hole at block 4: not counted
    scores = idx.score(TOKENS)
    assert scores[A].num_blocks == 4 and scores[A].weighted == 4.0
    assert scores[B].num_blocks == 6 and scores[B].weighted == pytest.approx(2 + 4 * 0.8)
    assert scores[B].blocks_per_tier == {"GPU": 2, "CPU": 4}
    idx.check_integrity()


def test_best_tier_counts_and_shared_external_tier_serves_everyone() -> None:
    idx = BlockIndex(BS)
    idx.apply_batch(A, batch(stored(HASHES[:3], "DISK"), stored(HASHES[:1], "GPU")))
    idx.apply_batch(B, batch(stored(HASHES[:3], "EXTERNAL")))
    scores = idx.score(TOKENS)
    assert scores[A].weighted == pytest.approx(1.0 + 0.5 + 0.5)
    assert scores[B].weighted == pytest.approx(0.9) and scores[B].num_blocks == 3
    private = BlockIndex(BS, external_shared=False)
    private.apply_batch(B, batch(stored(HASHES[:3], "EXTERNAL")))
    private.apply_batch(A, batch(stored(HASHES[:1], "GPU")))
    assert private.score(TOKENS)[B].num_blocks == 3  # its own store
    assert private.score(TOKENS)[A].num_blocks == 1  # B's store is not A's
    shared = BlockIndex(BS)
    shared.apply_batch(B, batch(stored(HASHES[:3], "EXTERNAL")))
    shared.apply_batch(A, batch(stored(HASHES[:1], "GPU")))
    assert shared.score(TOKENS)[A].blocks_per_tier == {"GPU": 1, "EXTERNAL": 2}
    for idx in (private, shared):
        idx.check_integrity()


def test_counts_survive_duplicates_and_removals() -> None:
    idx = BlockIndex(BS)
    idx.apply_batch(
        A, batch(stored(HASHES[:1]), stored(HASHES[:1]), BlockRemoved(HASHES[:1], "GPU"))
    )
    assert idx.holders(HASHES[0]) == {A: {"GPU"}}
    idx.apply_batch(A, batch(BlockRemoved(HASHES[:1], "GPU")))
    assert idx.holders(HASHES[0]) == {} and idx.num_entries == 0
    idx.apply_batch(A, batch(BlockRemoved(HASHES[:1], "GPU")))
    assert idx.stats.unmatched_removals == 1
    idx.check_integrity()
    assert idx.num_entries == 0  # nothing left behind


def test_clear_restart_and_loss_drop_only_that_instance() -> None:
    idx = BlockIndex(BS)
    idx.apply_batch(A, batch(stored(HASHES[:2])))
    idx.apply_batch(B, batch(stored(HASHES[:2])))
    idx.apply_batch(A, batch(AllBlocksCleared()))
    assert idx.holders(HASHES[0]) == {B: {"GPU"}}
    idx.apply_batch(A, batch(stored(HASHES[:1])))
    idx.apply_item(B, PublisherRestarted(StreamId("tcp://b:2", "", 0), 9, 0))
    assert idx.holders(HASHES[0]) == {A: {"GPU"}} and idx.stats.restarts == 1
    idx.apply_item(A, EventsLost(StreamId("tcp://a:2", "", 0), 3, 5))
    assert idx.holders(HASHES[0]) == {} and idx.instances[A].stale
    idx.apply_item(A, ReceivedBatch(6, batch(AllBlocksCleared()), StreamId("tcp://a:2", "", 0)))
    assert not idx.instances[A].stale
    idx.check_integrity()


def test_entry_cap_evicts_least_recently_stored() -> None:
    idx = BlockIndex(BS, max_entries=3)
    idx.apply_batch(A, batch(stored(HASHES[:5])))
    assert idx.num_entries == 3 and idx.stats.entries_evicted == 2
    assert idx.holders(HASHES[0]) == {} and idx.holders(HASHES[4]) == {A: {"GPU"}}
    idx.check_integrity()


def test_hash_mismatch_is_detected_and_logged_loudly(caplog: pytest.LogCaptureFixture) -> None:
    good = BlockIndex(BS)
    good.apply_batch(A, batch(stored(HASHES[:2], tokens=TOKENS[:8], parent=None)))
    assert good.stats.hash_mismatches == 0
    wrong_seed = BlockIndex(BS, hash_seed="other")
    with caplog.at_level(logging.ERROR):
        wrong_seed.apply_batch(A, batch(stored(HASHES[:2], tokens=TOKENS[:8], parent=None)))
        wrong_seed.apply_batch(A, batch(stored(HASHES[:2], tokens=TOKENS[:8], parent=None)))
    assert wrong_seed.stats.hash_mismatches == 2
    assert caplog.text.count("HASH MISMATCH") == 1


ops = st.lists(
    st.tuples(
        st.sampled_from([A, B]),
        st.sampled_from(["store", "store", "store", "remove", "clear", "restart", "lost"]),
        st.integers(0, 5),
        st.sampled_from(["GPU", "CPU", "DISK"]),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_index_matches_ground_truth_under_random_events(
    sequence: list[tuple[str, str, int, str]],
) -> None:
    idx = BlockIndex(BS, max_entries=10_000)
    truth: dict[str, Counter[tuple[int, str]]] = {A: Counter(), B: Counter()}
    for iid, op, i, medium in sequence:
        h = HASHES[i]
        if op == "store":
            idx.apply_batch(iid, batch(stored([h], medium)))
            truth[iid][(h, medium)] += 1
        elif op == "remove":
            idx.apply_batch(iid, batch(BlockRemoved([h], medium)))
            if truth[iid][(h, medium)] > 0:
                truth[iid][(h, medium)] -= 1
        elif op == "clear":
            idx.apply_batch(iid, batch(AllBlocksCleared()))
            truth[iid].clear()
        else:
            stream = StreamId("tcp://x:1", "", 0)
            item = PublisherRestarted(stream, 5, 0) if op == "restart" else EventsLost(stream, 1, 2)
            idx.apply_item(iid, item)
            truth[iid].clear()
        idx.check_integrity()
    for h in HASHES:
        expected = {
            iid: {m for (hh, m), n in c.items() if hh == h and n > 0} for iid, c in truth.items()
        }
        assert idx.holders(h) == {iid: ms for iid, ms in expected.items() if ms}
