import hashlib
import os
import random
import subprocess
import sys

import cbor2
import pytest
import xxhash

from kvconnect.hashing import (
    RequestBlockHasher,
    block_hashes,
    hash_block_tokens,
    request_extra_keys,
    seed_hash,
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


def test_golden_sha256_cbor_digests_by_hand() -> None:
    seed = hashlib.sha256(b"\x61\x30").digest()  # CBOR text string "0"
    assert seed_hash() == seed
    tokens = list(range(1, 33)) + [300, 70000] * 8
    expected, parent = [], seed
    for i in range(3):
        parent = hashlib.sha256(cbor_block(parent, tokens[i * 16 : (i + 1) * 16])).digest()
        expected.append(parent)
    assert block_hashes(tokens, 16) == expected
    # The same through cbor2 with Python tuples, as vLLM computes it.
    assert (
        hashlib.sha256(cbor2.dumps((seed, tuple(tokens[:16]), None), canonical=True)).digest()
        == expected[0]
    )
    # Pin the value itself, so that a change of scheme cannot pass unnoticed.
    assert expected[0].hex() == "202da172482d928bbc42ab25b0151e2b895f13f41002e27b2ceabcfae6d332ea"
    assert to_wire(expected[0]) == 3236607068019569386


def test_golden_xxhash_cbor_by_hand() -> None:
    seed = xxhash.xxh3_128(b"\x61\x30").digest()
    assert seed_hash("xxhash_cbor") == seed
    tokens = list(range(16))
    h = block_hashes(tokens, 16, algorithm="xxhash_cbor")
    assert h == [xxhash.xxh3_128(cbor_block(seed, tokens)).digest()]
    assert len(h[0]) == 16


def test_hash_block_tokens_matches_chain() -> None:
    tokens = list(range(48))
    hs = block_hashes(tokens, 16)
    assert hash_block_tokens(None, tokens[:16]) == hs[0]
    assert hash_block_tokens(hs[0], tokens[16:32]) == hs[1]
    assert hash_block_tokens(hs[1], tokens[32:48]) == hs[2]


def test_unknown_algorithm_lists_valid() -> None:
    with pytest.raises(ValueError, match=r"'md5'.*sha256_cbor, xxhash_cbor"):
        block_hashes([1] * 16, 16, algorithm="md5")
    with pytest.raises(ValueError, match="sha256_cbor"):
        hash_block_tokens(None, [1], algorithm="sha256")


def test_seed_changes_every_hash_and_defaults_to_zero() -> None:
    tokens = list(range(32))
    assert block_hashes(tokens, 16, seed="0") == block_hashes(tokens, 16)
    other = block_hashes(tokens, 16, seed="prod-cluster")
    assert all(a != b for a, b in zip(other, block_hashes(tokens, 16), strict=True))
    with pytest.raises(ValueError, match="seed"):
        seed_hash("sha256_cbor", 0)  # type: ignore[arg-type]


def test_deterministic_across_fresh_interpreters() -> None:
    code = (
        "from kvconnect.hashing import block_hashes;"
        "print(','.join(h.hex() for h in block_hashes(list(range(100)), 16, cache_salt='s')))"
    )
    outs = []
    for hashseed in ("random", "123"):
        env = {**os.environ, "PYTHONHASHSEED": hashseed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
        outs.append(out)
    here = ",".join(h.hex() for h in block_hashes(list(range(100)), 16, cache_salt="s"))
    assert outs[0] == outs[1] == here
    assert len(here.split(",")) == 6


def test_chaining_changes_every_later_hash() -> None:
    tokens = list(range(64))
    base = block_hashes(tokens, 16)
    changed0 = block_hashes([999, *tokens[1:]], 16)
    assert all(a != b for a, b in zip(base, changed0, strict=True))
    changed2 = [*tokens[:32], 999, *tokens[33:]]
    h2 = block_hashes(changed2, 16)
    assert h2[:2] == base[:2] and h2[2] != base[2] and h2[3] != base[3]


def test_cache_salt_only_enters_block_zero() -> None:
    tokens = list(range(48))
    salted = block_hashes(tokens, 16, cache_salt="tenant-a")
    plain = block_hashes(tokens, 16)
    assert all(a != b for a, b in zip(salted, plain, strict=True))  # through the chain
    assert salted[0] == hash_block_tokens(None, tokens[:16], ("tenant-a",))
    # Later blocks carry no salt of their own: only their parent differs.
    assert salted[1] == hash_block_tokens(salted[0], tokens[16:32], None)
    assert request_extra_keys(0, cache_salt="s") == ("s",)
    assert request_extra_keys(1, cache_salt="s") is None


def test_lora_name_enters_every_block_before_salt() -> None:
    tokens = list(range(32))
    h = block_hashes(tokens, 16, lora_name="sql", cache_salt="s")
    assert h[0] == hash_block_tokens(None, tokens[:16], ("sql", "s"))
    assert h[1] == hash_block_tokens(h[0], tokens[16:], ("sql",))
    explicit = block_hashes(tokens, 16, extra_keys=[("sql", "s"), ("sql",)])
    assert explicit == h


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
