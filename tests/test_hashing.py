import hashlib
import os
import pickle
import random
import subprocess
import sys

import cbor2
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconnect import hashing
from kvconnect.hashing import (
    ALGORITHMS,
    RequestBlockHasher,
    block_hashes,
    from_event,
    hash_block_tokens,
    is_reproducible,
    request_extra_keys,
    resolve_seed,
    seed_hash,
    to_event,
    to_wire,
)


def cbor_head(major: int, n: int) -> bytes:
    """The CBOR head of a major type with argument n (RFC 8949 section 3), written by hand."""
    if n < 24:
        return bytes([major << 5 | n])
    if n < 256:
        return bytes([major << 5 | 24, n])
    if n < 65536:
        return bytes([major << 5 | 25]) + n.to_bytes(2, "big")
    return bytes([major << 5 | 26]) + n.to_bytes(4, "big")


def cbor_block(parent: bytes, tokens: list[int]) -> bytes:
    """Canonical CBOR of (parent, tuple(tokens), None), by hand: array(3), bytes, array, null."""
    body = b"".join(cbor_head(0, t) for t in tokens)
    return (
        cbor_head(4, 3)
        + cbor_head(2, len(parent))
        + parent
        + cbor_head(4, len(tokens))
        + body
        + b"\xf6"
    )


@pytest.fixture(autouse=True)
def no_pythonhashseed(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's seed rule reads PYTHONHASHSEED: these tests start without it."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


def test_default_is_vllms_sha256_over_pickle_with_the_fixed_seed() -> None:
    none_hash = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()
    assert seed_hash() == none_hash
    tokens = list(range(48))
    expected, parent = [], none_hash
    for i in range(3):
        block = (parent, tuple(tokens[i * 16 : (i + 1) * 16]), None)
        parent = hashlib.sha256(pickle.dumps(block, protocol=5)).digest()
        expected.append(parent)
    assert block_hashes(tokens, 16) == expected
    # vLLM 0.33's documented values: block 0 of tokens 0..15 at its defaults.
    assert to_wire(expected[0]) == 3262291359910021016
    assert to_wire(block_hashes(tokens[:16], 16, algorithm="sha256_cbor")[0]) == (
        2233398808101521225
    )


def test_golden_sha256_cbor_digests_by_hand() -> None:
    seed = hashlib.sha256(b"\x61\x30").digest()  # CBOR text string "0"
    assert seed_hash("sha256_cbor", "0") == seed
    tokens = list(range(1, 33)) + [300, 70000] * 8
    expected, parent = [], seed
    for i in range(3):
        parent = hashlib.sha256(cbor_block(parent, tokens[i * 16 : (i + 1) * 16])).digest()
        expected.append(parent)
    assert block_hashes(tokens, 16, algorithm="sha256_cbor", seed="0") == expected
    # The same through cbor2 with Python tuples, as vLLM computes it.
    assert (
        hashlib.sha256(cbor2.dumps((seed, tuple(tokens[:16]), None), canonical=True)).digest()
        == expected[0]
    )
    # Pin the value itself, so that a change of scheme cannot pass unnoticed.
    assert expected[0].hex() == "202da172482d928bbc42ab25b0151e2b895f13f41002e27b2ceabcfae6d332ea"
    assert to_wire(expected[0]) == 3236607068019569386


def test_golden_xxhash_cbor_and_xxhash_pickle() -> None:
    seed = xxhash.xxh3_128(b"\x61\x30").digest()
    assert seed_hash("xxhash_cbor", "0") == seed
    tokens = list(range(16))
    h = block_hashes(tokens, 16, algorithm="xxhash_cbor", seed="0")
    assert h == [xxhash.xxh3_128(cbor_block(seed, tokens)).digest()]
    assert len(h[0]) == 16
    pickled_seed = xxhash.xxh3_128(pickle.dumps("0", protocol=5)).digest()
    block = pickle.dumps((pickled_seed, tuple(tokens), None), protocol=5)
    assert block_hashes(tokens, 16, algorithm="xxhash", seed="0") == [
        xxhash.xxh3_128(block).digest()
    ]


def test_hash_block_tokens_matches_chain() -> None:
    tokens = list(range(48))
    for algorithm in ALGORITHMS:
        hs = block_hashes(tokens, 16, algorithm=algorithm, seed="s")
        assert hash_block_tokens(None, tokens[:16], algorithm=algorithm, seed="s") == hs[0]
        assert hash_block_tokens(hs[0], tokens[16:32], algorithm=algorithm) == hs[1]
        assert hs[2:] == block_hashes(tokens[32:], 16, algorithm=algorithm, parent_hash=hs[1])


def test_unknown_algorithm_lists_valid() -> None:
    with pytest.raises(ValueError, match=r"'md5'.*sha256, sha256_cbor, xxhash, xxhash_cbor"):
        block_hashes([1] * 16, 16, algorithm="md5")
    with pytest.raises(ValueError, match="sha256_cbor"):
        hash_block_tokens(None, [1], algorithm="sha3")


def test_seed_changes_every_hash() -> None:
    tokens = list(range(32))
    assert block_hashes(tokens, 16, seed="vllm-none-hash") == block_hashes(tokens, 16)
    other = block_hashes(tokens, 16, seed="prod-cluster")
    assert all(a != b for a, b in zip(other, block_hashes(tokens, 16), strict=True))
    with pytest.raises(ValueError, match="seed"):
        seed_hash("sha256_cbor", 0)  # type: ignore[arg-type]


def test_pythonhashseed_replaces_the_seed_as_in_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = list(range(16))
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    for algorithm in ALGORITHMS:
        assert block_hashes(tokens, 16, algorithm=algorithm) == block_hashes(
            tokens, 16, algorithm=algorithm, seed="0"
        )
        assert is_reproducible(algorithm)
    assert resolve_seed("sha256", "explicit") == "explicit"  # a given seed wins over it


def test_xxhash_without_pythonhashseed_is_random_per_process() -> None:
    assert resolve_seed("sha256") == resolve_seed("sha256_cbor") == "vllm-none-hash"
    assert not is_reproducible("xxhash") and not is_reproducible("xxhash_cbor")
    assert resolve_seed("xxhash") == resolve_seed("xxhash_cbor")  # stable within a process
    assert len(resolve_seed("xxhash")) == 64


def run_fresh(code: str, pythonhashseed: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if pythonhashseed is not None:
        env["PYTHONHASHSEED"] = pythonhashseed
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_deterministic_across_fresh_interpreters_except_random_xxhash() -> None:
    code = (
        "import sys; from kvconnect.hashing import block_hashes;"
        "print(','.join(h.hex() for h in block_hashes(list(range(100)), 16, "
        "algorithm=sys.argv[1] if len(sys.argv) > 1 else 'sha256', cache_salt='s')))"
    )
    sha = [run_fresh(code, seed) for seed in (None, None)]
    here = ",".join(h.hex() for h in block_hashes(list(range(100)), 16, cache_salt="s"))
    assert sha[0] == sha[1] == here and len(here.split(",")) == 6
    assert run_fresh(code, "123") != here  # PYTHONHASHSEED replaces the seed
    xx = code.replace("else 'sha256'", "else 'xxhash'")
    assert run_fresh(xx, None) != run_fresh(xx, None)  # vLLM: random without PYTHONHASHSEED
    assert run_fresh(xx, "7") == run_fresh(xx, "7")


def test_chaining_changes_every_later_hash() -> None:
    tokens = list(range(64))
    base = block_hashes(tokens, 16)
    changed0 = block_hashes([999, *tokens[1:]], 16)
    assert all(a != b for a, b in zip(base, changed0, strict=True))
    changed2 = [*tokens[:32], 999, *tokens[33:]]
    h2 = block_hashes(changed2, 16)
    assert h2[:2] == base[:2] and h2[2] != base[2] and h2[3] != base[3]


def test_cache_salt_only_enters_block_zero_tagged_and_empty_is_none() -> None:
    tokens = list(range(48))
    salted = block_hashes(tokens, 16, cache_salt="tenant-a")
    plain = block_hashes(tokens, 16)
    assert all(a != b for a, b in zip(salted, plain, strict=True))  # through the chain
    assert salted[0] == hash_block_tokens(None, tokens[:16], (("cache_salt", "tenant-a"),))
    # Later blocks carry no salt of their own: only their parent differs.
    assert salted[1] == hash_block_tokens(salted[0], tokens[16:32], None)
    assert request_extra_keys(0, cache_salt="s") == (("cache_salt", "s"),)
    assert request_extra_keys(1, cache_salt="s") is None
    assert block_hashes(tokens, 16, cache_salt="") == plain  # vLLM: an empty salt is none


def test_lora_enters_every_block_before_the_salt_with_its_path() -> None:
    tokens = list(range(32))
    h = block_hashes(tokens, 16, lora_name="sql", lora_path="/a/sql", cache_salt="s")
    lora = ("lora", "sql", "/a/sql")
    assert h[0] == hash_block_tokens(None, tokens[:16], (lora, ("cache_salt", "s")))
    assert h[1] == hash_block_tokens(h[0], tokens[16:], (lora,))
    explicit = block_hashes(tokens, 16, extra_keys=[(lora, ("cache_salt", "s")), (lora,)])
    assert explicit == h
    assert block_hashes(tokens, 16, lora_name="sql", lora_path="/b/sql") != h  # path counts


def test_event_extra_keys_are_vllms_untagged_form_and_rebuild() -> None:
    tagged = (("mm", "img-1", 3), ("cache_salt", "s"), ("prompt_embeds", b"\x01" * 32))
    untagged = to_event(tagged)
    assert untagged == (("img-1", 3), "s", b"\x01" * 32)
    assert from_event(list(untagged), 0, None) == tagged  # a decoded event gives lists
    assert to_event(None) is None and from_event(None, 3, None) is None
    assert to_event((("lora", "sql", "/p"),)) == ("sql",)
    with pytest.raises(ValueError, match="adapter path"):
        from_event(["sql"], 0, "sql")  # the path is hashed but never published
    with pytest.raises(ValueError, match="no known shape"):
        from_event(["s"], 1, None)  # a salt only ever sits on block 0


def test_explicit_extra_keys_validation() -> None:
    with pytest.raises(ValueError, match="one entry"):
        block_hashes(list(range(32)), 16, extra_keys=[None])
    with pytest.raises(ValueError, match="not both"):
        block_hashes(list(range(16)), 16, extra_keys=[None], cache_salt="s")
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1], 0)


def test_incremental_hasher_equals_whole_and_skips_partial_blocks() -> None:
    rng = random.Random(7)
    tokens = [rng.randrange(50_000) for _ in range(203)]
    hasher = RequestBlockHasher(16, cache_salt="x")
    new_total = []
    i = 0
    while i < len(tokens):
        step = rng.randrange(1, 40)
        new_total += hasher.append(tokens[i : i + step])
        i += step
    whole = block_hashes(tokens, 16, cache_salt="x")
    assert hasher.block_hashes == whole == new_total
    assert len(whole) == 203 // 16
    assert hasher.num_tokens == 203
    assert hasher.append([1, 2]) == []


def test_wire_form() -> None:
    h = bytes(range(32))
    assert to_wire(h) == int.from_bytes(bytes(range(24, 32)), "big")
    assert to_wire(h, as_int=False) == h
    assert to_wire(b"\xff" * 32) == 2**64 - 1


# The fast CBOR path for blocks must write exactly cbor2's canonical bytes, for every shape
# a block can take and for shapes it must hand back to cbor2.
_cbor_ints = st.one_of(
    st.integers(0, 300),
    st.integers(0, 2**18 + 10),
    st.integers(-(2**64), 2**64 - 1),
    st.sampled_from([23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1, -1, -24, -25]),
)
_cbor_extras = st.one_of(
    st.none(),
    st.tuples(st.tuples(st.just("cache_salt"), st.text(max_size=20))),
    st.tuples(st.tuples(st.just("mm"), st.text(max_size=8), st.integers(0, 10**6))),
    st.tuples(st.tuples(st.just("lora"), st.text(max_size=8), st.none() | st.text(max_size=8))),
)


@settings(max_examples=400, deadline=None)
@given(
    parent=st.binary(max_size=300),
    tokens=st.lists(_cbor_ints, max_size=300).map(tuple),
    extra=_cbor_extras,
)
def test_fast_block_cbor_is_cbor2_canonical(
    parent: bytes, tokens: tuple[int, ...], extra: tuple[object, ...] | None
) -> None:
    obj = (parent, tokens, extra)
    assert hashing._cbor(obj) == cbor2.dumps(obj, canonical=True)


def test_fast_block_cbor_leaves_other_shapes_to_cbor2() -> None:
    parent = bytes(32)
    for obj in [
        "vllm-none-hash",
        (parent, (1.5, 2), None),  # a float token
        (parent, (2**64,), None),  # a bignum
        (parent, ("a",), None),
        (parent, [1, 2], None),  # a list, not a tuple
        (bytearray(parent), (1,), None),
        (parent, (1,), None, None),
    ]:
        assert hashing._cbor(obj) == cbor2.dumps(obj, canonical=True), obj
