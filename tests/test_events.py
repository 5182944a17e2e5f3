import contextlib
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconnect.events import (
    LOCALITY_LOCAL,
    LOCALITY_REMOTE,
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_EXTERNAL,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    MEDIUMS,
    TIER_CPU,
    TIER_GPU,
    TIER_STORAGE_LOCAL,
    TIER_STORAGE_REMOTE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    KVEventBatch,
    decode_batch,
    encode_batch,
    tier_of,
)


def s(text: str) -> bytes:
    """msgpack fixstr, by hand."""
    assert len(text) < 32
    return bytes([0xA0 | len(text)]) + text.encode()


def golden_batch() -> KVEventBatch:
    return KVEventBatch(
        ts=1.5,
        events=[
            BlockStored([2**64 - 1], None, [1, 2], 16, None, "GPU", None),
            BlockRemoved([7], "CPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=1,
    )


MAP_FORM = (
    b"\x93"
    + b"\xcb\x3f\xf8\x00\x00\x00\x00\x00\x00"
    + b"\x93"
    + b"\xde\x00\x08"  # map16: vLLM 0.33's BlockStored has 16 possible keys, 8 written
    + s("type")
    + s("BlockStored")
    + s("block_hashes")
    + b"\x91\xcf"
    + b"\xff" * 8
    + s("parent_block_hash")
    + b"\xc0"
    + s("token_ids")
    + b"\x92\x01\x02"
    + s("block_size")
    + b"\x10"
    + s("lora_id")
    + b"\xc0"
    + s("medium")
    + s("GPU")
    + s("lora_name")
    + b"\xc0"
    + b"\x83"
    + s("type")
    + s("BlockRemoved")
    + s("block_hashes")
    + b"\x91\x07"
    + s("medium")
    + s("CPU")
    + b"\x81"
    + s("type")
    + s("AllBlocksCleared")
    + b"\x01"
)

LEGACY_FORM = (
    b"\x93"
    + b"\xcb\x3f\xf8\x00\x00\x00\x00\x00\x00"
    + b"\x93"
    + b"\x98"
    + s("BlockStored")
    + b"\x91\xcf"
    + b"\xff" * 8
    + b"\xc0"
    + b"\x92\x01\x02"
    + b"\x10"
    + b"\xc0"
    + s("GPU")
    + b"\xc0"
    + b"\x93"
    + s("BlockRemoved")
    + b"\x91\x07"
    + s("CPU")
    + b"\x91"
    + s("AllBlocksCleared")
    + b"\x01"
)


def test_golden_bytes_map_form() -> None:
    assert encode_batch(golden_batch()) == MAP_FORM
    assert decode_batch(MAP_FORM) == golden_batch()


def test_golden_bytes_legacy_form() -> None:
    assert encode_batch(golden_batch(), legacy=True) == LEGACY_FORM
    assert decode_batch(LEGACY_FORM) == golden_batch()


def test_batch_without_rank_ends_with_nil_as_vllm_writes_it() -> None:
    b = KVEventBatch(2.0, [])
    assert msgspec.msgpack.decode(encode_batch(b)) == [2.0, [], None]
    assert msgspec.msgpack.decode(encode_batch(b, legacy=True)) == [2.0, [], None]
    assert decode_batch(encode_batch(b)) == b
    assert decode_batch(msgspec.msgpack.encode([2.0, []])) == b  # two elements read too


def full_stored() -> BlockStored:
    return BlockStored(
        block_hashes=[b"\x01" * 32, b"\x02" * 32],
        parent_block_hash=b"\x00" * 32,
        token_ids=list(range(32)),
        block_size=16,
        lora_id=3,
        medium=MEDIUM_STORAGE,
        lora_name="sql",
        extra_keys=[("sql", "salt"), ("sql",)],
        group_idx=1,
        kv_cache_spec_kind="full_attention",
        kv_cache_spec_sliding_window=4096,
        locality="LOCAL",
        ownership="tier-1",
        session_id="chat-42",
        lookahead_token_ids=[[5, 6], [7]],
    )


@pytest.mark.parametrize("legacy", [False, True])
def test_round_trip_every_field(legacy: bool) -> None:
    batch = KVEventBatch(
        123.25,
        [
            full_stored(),
            BlockRemoved([5, 2**63], MEDIUM_STORAGE, group_idx=2, locality="REMOTE"),
            AllBlocksCleared(),
        ],
        7,
    )
    assert decode_batch(encode_batch(batch, legacy=legacy)) == batch


def test_vllm_026_store_event_decodes() -> None:
    # The shape the spec quotes from a vLLM 0.26 dump, including fields set to defaults.
    raw = [
        1.0,
        [
            {
                "type": "BlockStored",
                "block_hashes": [11],
                "parent_block_hash": None,
                "token_ids": [1] * 16,
                "block_size": 16,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "extra_keys": [None],
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
            }
        ],
        0,
    ]
    batch = decode_batch(msgspec.msgpack.encode(raw))
    ev = batch.events[0]
    assert isinstance(ev, BlockStored)
    assert ev.extra_keys == [None] and ev.group_idx == 0
    assert ev.kv_cache_spec_kind == "full_attention"


def enc(obj: object) -> bytes:
    return msgspec.msgpack.encode(obj)


REMOVED_MAP = {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}


def test_tolerates_unknown_keys_and_key_order() -> None:
    ev = {
        "medium": "GPU",
        "future": {"x": 1},
        "block_hashes": [1],
        "type": "BlockRemoved",
        "session_id": "abc",
    }
    assert decode_batch(enc([1.0, [ev], 0])).events == [BlockRemoved([1], "GPU")]


def test_tolerates_two_element_batch_and_extra_trailing_fields() -> None:
    assert decode_batch(enc([1.0, [REMOVED_MAP]])).data_parallel_rank is None
    assert decode_batch(enc([1.0, [REMOVED_MAP], 3, "future"])).data_parallel_rank == 3
    legacy = ["BlockRemoved", [1], "GPU", 0, None, None, "future-field", 9]
    assert decode_batch(enc([1.0, [legacy], 0])).events == [BlockRemoved([1], "GPU", 0)]


def test_tolerates_mixed_event_shapes_and_map_batch() -> None:
    mixed = [1.0, [REMOVED_MAP, ["AllBlocksCleared"], ["BlockRemoved", [b"\x09" * 16], None]], 2]
    batch = decode_batch(enc(mixed))
    assert batch.events == [
        BlockRemoved([1], "GPU"),
        AllBlocksCleared(),
        BlockRemoved([b"\x09" * 16], None),
    ]
    as_map = {"ts": 1, "events": [REMOVED_MAP], "data_parallel_rank": 4}
    assert decode_batch(enc(as_map)) == KVEventBatch(1.0, [BlockRemoved([1], "GPU")], 4)


def test_unknown_medium_strings_decode() -> None:
    ev = {"type": "BlockRemoved", "block_hashes": [1], "medium": "cuda:0"}
    assert decode_batch(enc([1.0, [ev]])).events[0] == BlockRemoved([1], "cuda:0")
    assert (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE, LOCALITY_LOCAL, LOCALITY_REMOTE) == (
        "GPU",
        "CPU",
        "STORAGE",
        "LOCAL",
        "REMOTE",
    )
    assert MEDIUMS == ("GPU", "CPU", "STORAGE")  # what kvconnect publishes (vLLM 0.33's)
    assert (MEDIUM_DISK, MEDIUM_EXTERNAL) == ("DISK", "EXTERNAL")  # older streams, read only


def test_tier_of_names_each_tier_once_old_words_and_new() -> None:
    assert (TIER_GPU, TIER_CPU, TIER_STORAGE_LOCAL, TIER_STORAGE_REMOTE) == (
        "GPU",
        "CPU",
        "STORAGE/LOCAL",
        "STORAGE/REMOTE",
    )
    cases = [
        ((None, None), "GPU"),  # the engine's own cache, medium unset
        (("GPU", None), "GPU"),
        (("CPU", None), "CPU"),
        (("STORAGE", "LOCAL"), "STORAGE/LOCAL"),
        (("STORAGE", "REMOTE"), "STORAGE/REMOTE"),
        (("STORAGE", None), "STORAGE"),  # either: a tier of its own
        (("DISK", None), "STORAGE/LOCAL"),  # kvconnect before 0.2
        (("EXTERNAL", None), "STORAGE/REMOTE"),
        (("cuda:0", None), "cuda:0"),  # unknown: kept as it is
        (("NVME", "LOCAL"), "NVME/LOCAL"),
        (("CPU", "REMOTE"), "CPU/REMOTE"),
    ]
    for (medium, locality), tier in cases:
        assert tier_of(medium, locality) == tier, (medium, locality)
        assert tier_of(medium, locality) == tier  # the same again (it is cached)
    assert tier_of("CPU") == "CPU" and tier_of(None) == "GPU"  # locality defaults to None
    # Many made-up mediums: each still named right once the cache is full.
    assert all(tier_of(f"M{i}", "REMOTE") == f"M{i}/REMOTE" for i in range(2000))
    assert tier_of("DISK", None) == "STORAGE/LOCAL"


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"", "truncated"),
        (enc({"a": 1}), "ts"),
        (enc(5), "array"),
        (enc([1.0]), "array"),
        (enc(["x", []]), "ts"),
        (enc([1.0, "x"]), "events"),
        (enc([1.0, [], "r"]), "data_parallel_rank"),
        (enc([1.0, [{"type": "Nope"}]]), "unknown event type 'Nope'"),
        (enc([1.0, [{"block_hashes": [1]}]]), "unknown event type None"),
        (enc([1.0, [{"type": "BlockRemoved", "medium": "GPU"}]]), "block_hashes"),
        (enc([1.0, [{"type": "BlockRemoved", "block_hashes": ["x"], "medium": None}]]), "int"),
        (enc([1.0, [["BlockStored", [1], None]]]), "token_ids"),
        (enc([1.0, [7]]), "map or an array"),
    ],
)
def test_bad_payloads_raise_event_decode_error_with_reason(payload: bytes, reason: str) -> None:
    with pytest.raises(EventDecodeError, match=reason):
        decode_batch(payload)


def test_events_are_hashable_and_compare_by_value() -> None:
    a = full_stored()
    b = decode_batch(encode_batch(KVEventBatch(0.0, [full_stored()]))).events[0]
    assert a == b and hash(a) == hash(b)
    assert (
        len(
            {
                AllBlocksCleared(),
                AllBlocksCleared(),
                BlockRemoved([1], "GPU"),
                BlockRemoved([1], "GPU"),
                BlockRemoved([1], "CPU"),
            }
        )
        == 3
    )
    assert BlockRemoved([1], "GPU") != BlockRemoved([1], "GPU", group_idx=0)
    # Decoded extra keys nest arrays (lists); they still hash.
    raw = enc(
        [
            0.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [1],
                    "parent_block_hash": None,
                    "token_ids": [],
                    "block_size": 16,
                    "lora_id": None,
                    "medium": "CPU",
                    "lora_name": None,
                    "extra_keys": [[["mm", 3], "salt"]],
                }
            ],
        ]
    )
    ev = decode_batch(raw).events[0]
    assert hash(ev) == hash(decode_batch(raw).events[0])


VALID = [
    encode_batch(golden_batch()),
    LEGACY_FORM,
    encode_batch(KVEventBatch(9.0, [full_stored(), BlockRemoved([1], None)], 0)),
]


def decode_or_error(data: bytes) -> None:
    with contextlib.suppress(EventDecodeError):
        assert isinstance(decode_batch(data), KVEventBatch)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_only_raise_event_decode_error(data: bytes) -> None:
    decode_or_error(data)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(VALID), st.data())
def test_truncated_and_mutated_payloads_only_raise_event_decode_error(
    payload: bytes, data: st.DataObject
) -> None:
    cut = data.draw(st.integers(0, len(payload) - 1))
    with pytest.raises(EventDecodeError):
        decode_batch(payload[:cut])
    mutated = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(payload) - 1))
        mutated[pos] = data.draw(st.integers(0, 255))
    decode_or_error(bytes(mutated))


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.floats()
        | st.text(max_size=5)
        | st.binary(max_size=5),
        lambda kids: (
            st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
        ),
        max_leaves=20,
    )
)
def test_random_msgpack_structures_only_raise_event_decode_error(obj: object) -> None:
    decode_or_error(enc(obj))
    decode_or_error(enc([1.0, [obj], 0]))
    decode_or_error(enc([1.0, [{"type": "BlockStored", "block_hashes": obj}], 0]))


# vLLM 0.33's event structs, field for field (the release kv_events.py), as a producer writes
# them: kvconnect must read any such batch and write back the very same bytes.
class V33Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class V33Stored(V33Event, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class V33Removed(V33Event, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class V33Cleared(V33Event, tag="AllBlocksCleared"):
    pass


class V33Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[V33Stored | V33Removed | V33Cleared]
    data_parallel_rank: int | None = None


opt_str = st.none() | st.text(max_size=8)
hashes = st.lists(st.integers(0, 2**64 - 1) | st.binary(min_size=32, max_size=32), max_size=4)
v33_stored = st.builds(
    V33Stored,
    hashes,
    st.none() | st.integers(0, 2**64 - 1),
    st.lists(st.integers(0, 2**20), max_size=8),
    st.integers(1, 128),
    st.none() | st.integers(0, 9),
    opt_str,
    opt_str,
    extra_keys=st.none() | st.lists(st.none() | st.tuples(st.text(max_size=4)), max_size=3),
    group_idx=st.none() | st.integers(0, 3),
    kv_cache_spec_kind=opt_str,
    kv_cache_spec_sliding_window=st.none() | st.integers(1, 8192),
    locality=st.none() | st.sampled_from(["LOCAL", "REMOTE"]),
    ownership=opt_str,
    session_id=opt_str,
    lookahead_token_ids=st.none() | st.lists(st.lists(st.integers(0, 99), max_size=3), max_size=2),
)
v33_removed = st.builds(
    V33Removed,
    hashes,
    opt_str,
    group_idx=st.none() | st.integers(0, 3),
    locality=opt_str,
    ownership=opt_str,
)
v33_batches = st.builds(
    V33Batch,
    st.floats(allow_nan=False, allow_infinity=False),
    st.lists(v33_stored | v33_removed | st.just(V33Cleared()), max_size=5),
    st.none() | st.integers(0, 7),
)


@settings(max_examples=300, deadline=None)
@given(v33_batches)
def test_any_vllm_033_batch_decodes_and_encodes_byte_identically(batch: V33Batch) -> None:
    wire = msgspec.msgpack.encode(batch)
    assert encode_batch(decode_batch(wire)) == wire
