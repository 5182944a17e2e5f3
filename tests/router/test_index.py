import logging
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconnect.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvconnect.hashing import block_hashes, to_wire
from kvconnect.router.index import BlockIndex
from kvconnect.router.schemes import HashScheme
from kvconnect.stream.subscriber import EventsLost, PublisherRestarted, ReceivedBatch, StreamId

A, B = "http://a:1", "http://b:1"
BS = 4
TOKENS = list(range(1, 25))  # 6 blocks
HASHES = [to_wire(h) for h in block_hashes(TOKENS, BS)]


def stored(
    hashes: list[int],
    medium: str = "GPU",
    tokens: list[int] | None = None,
    parent: int | None = 1,
    locality: str | None = None,
) -> BlockStored:
    return BlockStored(hashes, parent, tokens or [], BS, None, medium, None, locality=locality)


def local(hashes: list[int], **kw: object) -> BlockStored:
    """Held on the instance's own disk, as vLLM 0.33 says it."""
    return stored(hashes, "STORAGE", locality="LOCAL", **kw)  # type: ignore[arg-type]


def remote(hashes: list[int], **kw: object) -> BlockStored:
    """Held in a store the instances share (Redis), as vLLM 0.33 says it."""
    return stored(hashes, "STORAGE", locality="REMOTE", **kw)  # type: ignore[arg-type]


def batch(*events: object) -> KVEventBatch:
    return KVEventBatch(0.0, list(events), 0)  # type: ignore[arg-type]


def test_longest_consecutive_prefix_per_instance_with_tier_weights() -> None:
    idx = BlockIndex(BS)
    idx.apply_batch(A, batch(stored(HASHES[:4], "GPU")))
    idx.apply_batch(B, batch(stored(HASHES[:2], "GPU"), stored(HASHES[2:6], "CPU")))
    idx.apply_batch(A, batch(stored(HASHES[5:6], "GPU")))  # a hole at block 4: not counted
    scores = idx.score_hashes(HASHES)
    assert scores[A].num_blocks == 4 and scores[A].weighted == 4.0
    assert scores[B].num_blocks == 6 and scores[B].weighted == pytest.approx(2 + 4 * 0.8)
    assert scores[B].blocks_per_tier == {"GPU": 2, "CPU": 4}
    idx.check_integrity()


def test_best_tier_counts_and_shared_external_tier_serves_everyone() -> None:
    idx = BlockIndex(BS)
    idx.apply_batch(A, batch(local(HASHES[:3]), stored(HASHES[:1], "GPU")))
    idx.apply_batch(B, batch(remote(HASHES[:3])))
    scores = idx.score_hashes(HASHES)
    assert scores[A].weighted == pytest.approx(1.0 + 0.5 + 0.5)
    assert scores[B].weighted == pytest.approx(0.9) and scores[B].num_blocks == 3
    private = BlockIndex(BS, external_shared=False)
    private.apply_batch(B, batch(remote(HASHES[:3])))
    private.apply_batch(A, batch(stored(HASHES[:1], "GPU")))
    assert private.score_hashes(HASHES)[B].num_blocks == 3  # its own store
    assert private.score_hashes(HASHES)[A].num_blocks == 1  # B's store is not A's
    shared = BlockIndex(BS)
    shared.apply_batch(B, batch(remote(HASHES[:3])))
    shared.apply_batch(A, batch(stored(HASHES[:1], "GPU")))
    assert shared.score_hashes(HASHES)[A].blocks_per_tier == {"GPU": 1, "STORAGE/REMOTE": 2}
    for idx in (private, shared):
        idx.check_integrity()


def test_a_remote_block_counts_for_every_instance_a_local_one_only_for_its_own() -> None:
    idx = BlockIndex(BS)
    idx.apply_batch(A, batch(stored(HASHES[:1], "GPU")))
    idx.apply_batch(B, batch(remote(HASHES[:3]), local(HASHES[:5])))
    scores = idx.score_hashes(HASHES)
    # A: its GPU block, then B's Redis blocks; B's disk (block 3 on) is not A's.
    assert scores[A].num_blocks == 3
    assert scores[A].blocks_per_tier == {"GPU": 1, "STORAGE/REMOTE": 2}
    assert scores[A].weighted == pytest.approx(1.0 + 2 * 0.3)
    assert scores[B].blocks_per_tier == {"STORAGE/LOCAL": 5}  # its best tier for each
    assert scores[B].weighted == pytest.approx(5 * 0.5)
    assert idx.holders(HASHES[3]) == {B: {"STORAGE/LOCAL"}}
    assert idx.holders(HASHES[0]) == {A: {"GPU"}, B: {"STORAGE/LOCAL", "STORAGE/REMOTE"}}
    assert idx.blocks_of(B, "STORAGE", "REMOTE") == set(HASHES[:3])
    assert idx.blocks_of(B, "STORAGE", "LOCAL") == set(HASHES[:5])
    assert idx.blocks_of(A, "STORAGE", "REMOTE") == set()  # B announced them, not A
    # STORAGE with no locality may be either: weighted 0.3, and not shared.
    bare = BlockIndex(BS)
    bare.apply_batch(A, batch(stored(HASHES[:1], "GPU")))
    bare.apply_batch(B, batch(stored(HASHES[:3], "STORAGE")))
    assert bare.score_hashes(HASHES)[A].num_blocks == 1
    assert bare.score_hashes(HASHES)[B].blocks_per_tier == {"STORAGE": 3}
    assert bare.score_hashes(HASHES)[B].weighted == pytest.approx(3 * 0.3)
    for i in (idx, bare):
        i.check_integrity()


def test_a_legacy_stream_and_a_vllm_033_one_score_alike() -> None:
    """kvconnect before 0.2 said DISK and EXTERNAL; vLLM 0.33 says STORAGE, LOCAL or REMOTE.
    The index reads both as the same tiers."""

    def run(disk: tuple[str, str | None], redis: tuple[str, str | None]) -> BlockIndex:
        idx = BlockIndex(BS)
        gpu = stored(HASHES[:1], "GPU")
        idx.apply_batch(A, batch(gpu, stored(HASHES[:4], disk[0], locality=disk[1])))
        idx.apply_batch(B, batch(stored(HASHES[:6], redis[0], locality=redis[1])))
        idx.apply_batch(A, batch(BlockRemoved(HASHES[3:4], disk[0], locality=disk[1])))
        idx.apply_batch(B, batch(BlockRemoved(HASHES[5:6], redis[0], locality=redis[1])))
        idx.check_integrity()
        return idx

    old = run(("DISK", None), ("EXTERNAL", None))
    new = run(("STORAGE", "LOCAL"), ("STORAGE", "REMOTE"))
    assert old.score_hashes(HASHES) == new.score_hashes(HASHES)
    scores = new.score_hashes(HASHES)
    assert scores[A].blocks_per_tier == {"GPU": 1, "STORAGE/LOCAL": 2, "STORAGE/REMOTE": 2}
    assert scores[A].weighted == pytest.approx(1.0 + 2 * 0.5 + 2 * 0.3)
    assert scores[B].blocks_per_tier == {"STORAGE/REMOTE": 5}
    assert old.stats.removed == new.stats.removed
    assert new.stats.removed == Counter({"STORAGE/LOCAL": 1, "STORAGE/REMOTE": 1})
    for h in HASHES:
        assert old.holders(h) == new.holders(h)
    assert old.blocks_of(A, "DISK") == new.blocks_of(A, "STORAGE", "LOCAL") == set(HASHES[:3])
    # A stream that changes words midway (a connector upgraded) takes back what it stored.
    mixed = BlockIndex(BS)
    mixed.apply_batch(A, batch(stored(HASHES[:2], "DISK"), stored(HASHES[:2], "EXTERNAL")))
    mixed.apply_batch(
        A,
        batch(
            BlockRemoved(HASHES[:2], "STORAGE", locality="LOCAL"),
            BlockRemoved(HASHES[:2], "STORAGE", locality="REMOTE"),
        ),
    )
    assert mixed.num_entries == 0
    assert mixed.stats.removed == Counter({"STORAGE/LOCAL": 2, "STORAGE/REMOTE": 2})
    mixed.check_integrity()


def test_an_unknown_tier_counts_a_little_and_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    idx = BlockIndex(BS)
    with caplog.at_level(logging.WARNING, logger="kvconnect.router.index"):
        idx.apply_batch(A, batch(stored(HASHES[:3], "NVME")))
        idx.apply_batch(A, batch(stored(HASHES[3:5], "NVME")))
        idx.apply_batch(B, batch(stored(HASHES[:2], "NVME"), stored(HASHES[2:3], "GPU")))
        idx.apply_batch(B, batch(stored(HASHES[3:4], "STORAGE", locality="NEARBY")))
        idx.apply_batch(B, batch(stored(HASHES[4:5], "STORAGE", locality="NEARBY")))
    scores = idx.score_hashes(HASHES)
    assert scores[A].num_blocks == 5 and scores[A].weighted == pytest.approx(5 * 0.1)
    assert scores[A].blocks_per_tier == {"NVME": 5}
    assert scores[B].blocks_per_tier == {"NVME": 2, "GPU": 1, "STORAGE/NEARBY": 2}
    assert scores[B].weighted == pytest.approx(2 * 0.1 + 1.0 + 2 * 0.1)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2, warned  # one per tier, not per event or per instance
    assert "'NVME'" in warned[0] and "'STORAGE/NEARBY'" in warned[1]
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


def test_entry_cap_evicts_the_oldest_down_to_a_64th_below_it_and_a_store_again_is_new() -> None:
    idx = BlockIndex(BS, max_entries=128)
    hashes = list(range(1000, 1129))  # 129: one past the cap
    idx.apply_batch(A, batch(stored(hashes[:128])))
    idx.apply_batch(B, batch(stored(hashes[:1])))  # the oldest hash, stored again: the newest
    assert idx.num_entries == 128 and idx.stats.entries_evicted == 0
    idx.apply_batch(A, batch(stored(hashes[128:])))
    # 129 entries: down to 128 - 128 // 64 = 126, the three least recently stored gone
    assert idx.num_entries == 126 and idx.stats.entries_evicted == 3
    assert [h for h in hashes if not idx.holders(h)] == hashes[1:4]
    assert idx.holders(hashes[0]) == {A: {"GPU"}, B: {"GPU"}}
    idx.check_integrity()


def test_blocks_of_one_instance_and_tier_share_one_holder_key() -> None:
    idx = BlockIndex(BS)
    idx.apply_batch(A, batch(stored(HASHES[:2]), stored(HASHES[2:4])))
    keys = {id(idx._entries[h]) for h in HASHES[:4]}
    assert len(keys) == 1  # one tuple, not one per event
    idx.clear_instance(A)
    idx.apply_batch(A, batch(stored(HASHES[:1])))
    assert idx._entries[HASHES[0]] == (0, 1, "GPU")  # a new generation: a new key
    idx.check_integrity()


def engine_event(
    tokens: list[int],
    scheme: HashScheme,
    block_size: int = BS,
    *,
    salt: str | None = None,
    parent: bytes | None = None,
    medium: str = "GPU",
) -> tuple[BlockStored, list[bytes]]:
    """The BlockStored an engine hashing with `scheme` publishes for these tokens (a whole
    prefix, or a continuation after `parent`), and the raw hashes (to continue from)."""
    raw = (
        block_hashes(
            tokens, block_size, algorithm=scheme.algorithm, seed=scheme.seed, cache_salt=salt
        )
        if parent is None
        else block_hashes(
            tokens, block_size, algorithm=scheme.algorithm, seed=scheme.seed, parent_hash=parent
        )
    )
    n = len(raw)
    keys: list[tuple[object, ...] | None] = [None] * n
    if salt and parent is None:
        keys[0] = (salt,)
    event = BlockStored(
        [to_wire(h) for h in raw],
        None if parent is None else to_wire(parent),
        tokens[: n * block_size],
        block_size,
        None,
        medium,
        None,
        extra_keys=keys,
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )
    return event, raw


VLLM_DEFAULT = HashScheme("sha256", "vllm-none-hash")


@pytest.mark.parametrize(
    "scheme",
    [
        VLLM_DEFAULT,
        HashScheme("sha256", "0"),  # vLLM run with PYTHONHASHSEED=0
        HashScheme("sha256_cbor", "vllm-none-hash"),
        HashScheme("xxhash", "0"),
        HashScheme("xxhash_cbor", "0"),
    ],
)
def test_the_scheme_of_each_instance_is_learned_from_its_stream(scheme: HashScheme) -> None:
    idx = BlockIndex()  # defaults: vLLM's sha256 and seed rule, 16-token blocks
    event, _ = engine_event(TOKENS, scheme, block_size=8)
    idx.apply_batch(A, batch(event))
    assert idx.schemes() == {A: (str(scheme), 8)}
    score = idx.score(TOKENS)[A]  # hashed its way, at its block size
    assert (score.num_blocks, score.block_size, score.num_tokens) == (3, 8, 24)
    assert idx.stats.hash_mismatches == 0
    idx.check_integrity()


def test_an_unreproducible_scheme_is_keyed_by_the_routers_own_chain(
    caplog: pytest.LogCaptureFixture,
) -> None:
    private = HashScheme("xxhash", "a random per-process seed")  # vLLM's xxhash default
    idx = BlockIndex()
    first, raw = engine_event(TOKENS[:8], private)
    more, raw2 = engine_event(TOKENS[8:], private, parent=raw[-1])
    offload = BlockStored([to_wire(raw[0])], None, [], BS, None, "CPU", None)  # no tokens
    with caplog.at_level(logging.WARNING):
        idx.apply_batch(A, batch(first, more, offload))
    assert idx.schemes()[A] == ("router-keyed:sha256:vllm-none-hash", BS)
    assert "no known hash scheme reproduces" in caplog.text
    score = idx.score(TOKENS)[A]
    assert score.num_blocks == 6 and score.blocks_per_tier == {"GPU": 6}
    assert idx.holders(idx.request_hashes(TOKENS, BS)[0]) == {A: {"GPU", "CPU"}}
    # Removals name engine hashes: they resolve through the router's map.
    idx.apply_batch(A, batch(BlockRemoved([to_wire(h) for h in raw2], "GPU")))
    assert idx.score(TOKENS)[A].num_blocks == 2
    unknown = BlockStored([12345], None, [], BS, None, "CPU", None)
    idx.apply_batch(A, batch(unknown, BlockRemoved([999], "GPU")))
    inst = idx.instances[A]
    assert inst.router_keys is not None and inst.router_keys.num_unresolvable == 2
    idx.apply_batch(A, batch(BlockRemoved([to_wire(h) for h in raw], "GPU")))
    idx.apply_batch(A, batch(BlockRemoved([to_wire(raw[0])], "CPU")))
    idx.check_integrity()
    assert idx.num_entries == 0 and len(inst.router_keys) == 0  # nothing left behind


def test_instances_with_different_block_sizes_are_scored_each_at_its_own() -> None:
    idx = BlockIndex()
    idx.apply_batch(A, batch(engine_event(TOKENS, VLLM_DEFAULT, block_size=4)[0]))
    idx.apply_batch(B, batch(engine_event(TOKENS, VLLM_DEFAULT, block_size=8)[0]))
    scores = idx.score([*TOKENS, 7, 7, 7])
    assert (scores[A].num_blocks, scores[A].num_tokens) == (6, 24)
    assert (scores[B].num_blocks, scores[B].num_tokens) == (3, 24)
    idx.check_integrity()


def test_a_cache_salt_in_extra_keys_is_learned_and_scored() -> None:
    idx = BlockIndex()
    event, _ = engine_event(TOKENS, VLLM_DEFAULT, salt="tenant-a")
    idx.apply_batch(A, batch(event))
    assert idx.schemes()[A] == (str(VLLM_DEFAULT), BS)
    assert idx.score(TOKENS, cache_salt="tenant-a")[A].num_blocks == 6
    assert idx.score(TOKENS)[A].num_blocks == 0  # unsalted, the same tokens are other blocks
    idx.check_integrity()


def test_events_that_contradict_their_tokens_are_a_mismatch_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    idx = BlockIndex()
    good, _ = engine_event(TOKENS, VLLM_DEFAULT)
    idx.apply_batch(A, batch(good))
    lying = BlockStored([1, 2], None, TOKENS[:8], BS, None, "GPU", None)
    other = BlockIndex()
    other.apply_batch(B, batch(good))
    with caplog.at_level(logging.ERROR):
        idx.apply_batch(A, batch(lying))
        other.apply_batch(B, batch(lying))
    assert idx.stats.hash_mismatches == 1 and caplog.text.count("HASH MISMATCH") == 2
    # It was cleared and keyed anew; its own hashes cannot be trusted, so by the router's
    # chain over the tokens it announces, which routes whatever its hashes say.
    assert idx.schemes()[A][0].startswith("router-keyed:")
    assert idx.score(TOKENS)[A].num_blocks == 2  # the lying event's own two blocks, by tokens
    idx.apply_batch(A, batch(good))
    assert idx.score(TOKENS)[A].num_blocks == 6
    idx.check_integrity()


def test_a_restart_relearns_the_scheme() -> None:
    idx = BlockIndex()
    idx.apply_batch(A, batch(engine_event(TOKENS, HashScheme("xxhash", "seed-1"))[0]))
    assert idx.schemes()[A][0].startswith("router-keyed:")
    idx.apply_item(A, PublisherRestarted(StreamId("tcp://a:2", "", 0), 9, 0))
    assert idx.schemes()[A] == ("unknown", None)
    idx.apply_batch(A, batch(engine_event(TOKENS, VLLM_DEFAULT)[0]))
    assert idx.schemes()[A] == (str(VLLM_DEFAULT), BS)
    assert idx.score(TOKENS)[A].num_blocks == 6
    idx.check_integrity()


ops = st.lists(
    st.tuples(
        st.sampled_from([A, B]),
        st.sampled_from(["store", "store", "store", "remove", "clear", "restart", "lost"]),
        st.integers(0, 5),
        # (medium, locality); the older DISK is the same tier as STORAGE/LOCAL
        st.sampled_from([("GPU", None), ("CPU", None), ("STORAGE", "LOCAL"), ("DISK", None)]),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_index_matches_ground_truth_under_random_events(
    sequence: list[tuple[str, str, int, tuple[str, str | None]]],
) -> None:
    idx = BlockIndex(BS, max_entries=10_000)
    truth: dict[str, Counter[tuple[int, str]]] = {A: Counter(), B: Counter()}
    for iid, op, i, (medium, locality) in sequence:
        h = HASHES[i]
        tier = "STORAGE/LOCAL" if medium in ("STORAGE", "DISK") else medium
        if op == "store":
            idx.apply_batch(iid, batch(stored([h], medium, locality=locality)))
            truth[iid][(h, tier)] += 1
        elif op == "remove":
            idx.apply_batch(iid, batch(BlockRemoved([h], medium, locality=locality)))
            if truth[iid][(h, tier)] > 0:
                truth[iid][(h, tier)] -= 1
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


def test_removals_are_counted_per_tier_and_a_load_miss_marks_entries_stale() -> None:
    idx = BlockIndex(BS)
    first = stored(HASHES[:2], "GPU", tokens=TOKENS[:8], parent=None)  # teaches the scheme
    idx.apply_batch(A, batch(first, stored(HASHES[2:5], "CPU", parent=HASHES[1])))
    idx.apply_batch(B, batch(remote(HASHES[:5], tokens=TOKENS[:20], parent=None)))
    idx.apply_batch(A, batch(BlockRemoved(HASHES[4:5], "CPU")))
    assert idx.stats.removed == Counter({"CPU": 1})
    assert idx.score(TOKENS)[A].num_blocks == 5  # GPU 0-1, CPU 2-3, shared STORAGE/REMOTE 4
    # A reports 8 cached tokens (2 blocks): blocks 2-4 are not where the index said. Its own
    # CPU entries and the shared STORAGE/REMOTE ones for them go; B's blocks 0-1 stay.
    assert idx.mark_stale(A, TOKENS, 8) == 2 + 3
    assert idx.stats.stale == Counter({"CPU": 2, "STORAGE/REMOTE": 3})
    assert idx.score(TOKENS)[A].num_blocks == 2 and idx.score(TOKENS)[B].num_blocks == 2
    # The prompt's last token is always computed: an answer one block short of a prompt
    # that ends on a block boundary is not a miss.
    assert idx.mark_stale(A, TOKENS[:8], 4) == 0
    assert idx.mark_stale("http://unknown:1", TOKENS, 0) == 0
    idx.apply_batch(B, batch(BlockRemoved(HASHES[1:2], "STORAGE", locality="REMOTE")))
    assert idx.stats.removed == Counter({"CPU": 1, "STORAGE/REMOTE": 1})
    assert idx.score(TOKENS)[B].num_blocks == 1
    idx.check_integrity()
