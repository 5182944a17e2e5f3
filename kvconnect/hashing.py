"""Chained, content-addressed block hashes, identical in every process that shares the settings.

A block's hash covers its parent's hash, its token ids and its extra keys, so it names the
whole prefix that ends with that block:

    block 0: H0 = h((seed_hash, tokens[0:B],  extra_0))
    block 1: H1 = h((H0,        tokens[B:2B], extra_1))
    block 2: H2 = h((H1,        tokens[2B:3B], extra_2))

`h` serialises the 3-tuple with canonical CBOR, which any language can reproduce, then takes
SHA-256 (`sha256_cbor`, 32 bytes, the default) or xxh3-128 (`xxhash_cbor`, 16 bytes). This is
vLLM's scheme. The seed hash, the parent of block 0, is `h(seed)` of a configured seed string;
the default seed "0" reproduces vLLM run with `PYTHONHASHSEED=0`. It never comes from process
randomness, so engines, offload tiers and routers agree without coordination.

Only full blocks are hashed. Extra keys follow vLLM's order: the LoRA name on every block,
then `cache_salt` on the block that starts at token 0 only.

On the wire (KV cache events) a hash is, by default, the last 8 digest bytes read as an
unsigned 64-bit integer, as vLLM sends it; `to_wire(h, as_int=False)` keeps the raw bytes.
This module imports nothing from the rest of the package.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any, Literal, overload

import cbor2
import xxhash

DEFAULT_ALGORITHM = "sha256_cbor"
DEFAULT_SEED = "0"

HashFn = Callable[[Any], bytes]
ExtraKeys = tuple[Any, ...]


def sha256_cbor(obj: Any) -> bytes:
    """SHA-256 of the canonical CBOR encoding of `obj` (32 bytes)."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def xxhash_cbor(obj: Any) -> bytes:
    """xxh3-128 of the canonical CBOR encoding of `obj` (16 bytes)."""
    return bytes(xxhash.xxh3_128(cbor2.dumps(obj, canonical=True)).digest())


HASH_FUNCTIONS: dict[str, HashFn] = {"sha256_cbor": sha256_cbor, "xxhash_cbor": xxhash_cbor}


def get_hash_fn(algorithm: str) -> HashFn:
    """The hash function named `algorithm`; `ValueError` listing the valid names otherwise."""
    try:
        return HASH_FUNCTIONS[algorithm]
    except (KeyError, TypeError):
        valid = ", ".join(HASH_FUNCTIONS)
        raise ValueError(f"unknown hash algorithm {algorithm!r}; valid: {valid}") from None


@lru_cache(maxsize=64)
def seed_hash(algorithm: str = DEFAULT_ALGORITHM, seed: str | None = None) -> bytes:
    """The parent hash of block 0 (vLLM's `NONE_HASH`) for this algorithm and seed string."""
    if seed is not None and not isinstance(seed, str):
        raise ValueError(f"hash seed must be a string, got {seed!r}")
    return get_hash_fn(algorithm)(DEFAULT_SEED if seed is None else seed)


def hash_block_tokens(
    parent_hash: bytes | None,
    token_ids: Sequence[int],
    extra_keys: ExtraKeys | None = None,
    *,
    algorithm: str = DEFAULT_ALGORITHM,
    seed: str | None = None,
) -> bytes:
    """Hash of one full block given its parent's hash (None for block 0)."""
    if not parent_hash:
        parent_hash = seed_hash(algorithm, seed)
    return get_hash_fn(algorithm)((parent_hash, tuple(token_ids), extra_keys))


def request_extra_keys(
    block_index: int, *, lora_name: str | None = None, cache_salt: str | None = None
) -> ExtraKeys | None:
    """Extra keys of a request's block: LoRA name on all blocks, the salt on block 0 only."""
    keys: list[Any] = []
    if lora_name is not None:
        keys.append(lora_name)
    if cache_salt is not None and block_index == 0:
        keys.append(cache_salt)
    return tuple(keys) if keys else None


class RequestBlockHasher:
    """Hashes a request's full blocks incrementally as its tokens grow.

    `append()` takes new tokens and returns the hashes of the blocks they completed; tokens of
    a partial block wait until the block is full.
    """

    def __init__(
        self,
        block_size: int,
        *,
        algorithm: str = DEFAULT_ALGORITHM,
        seed: str | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.block_size = block_size
        self._hash_fn = get_hash_fn(algorithm)
        self._parent = seed_hash(algorithm, seed)
        self._lora_name = lora_name
        self._cache_salt = cache_salt
        self._pending: list[int] = []
        self.block_hashes: list[bytes] = []

    @property
    def num_tokens(self) -> int:
        return len(self.block_hashes) * self.block_size + len(self._pending)

    def append(self, token_ids: Sequence[int]) -> list[bytes]:
        """Add tokens; return the hashes of the blocks that became full."""
        pending = self._pending
        pending.extend(token_ids)
        new: list[bytes] = []
        bs = self.block_size
        start = 0
        while len(pending) - start >= bs:
            block = tuple(pending[start : start + bs])
            extra = request_extra_keys(
                len(self.block_hashes), lora_name=self._lora_name, cache_salt=self._cache_salt
            )
            self._parent = self._hash_fn((self._parent, block, extra))
            self.block_hashes.append(self._parent)
            new.append(self._parent)
            start += bs
        if start:
            del pending[:start]
        return new


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    algorithm: str = DEFAULT_ALGORITHM,
    seed: str | None = None,
    extra_keys: Sequence[ExtraKeys | None] | None = None,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[bytes]:
    """Chained hashes of every full block of `token_ids`.

    Extra keys come either from `lora_name`/`cache_salt` (the request form) or explicitly,
    one entry per full block, as a `BlockStored` event carries them in `extra_keys`.
    """
    if extra_keys is None:
        hasher = RequestBlockHasher(
            block_size, algorithm=algorithm, seed=seed, lora_name=lora_name, cache_salt=cache_salt
        )
        return hasher.append(token_ids)
    if lora_name is not None or cache_salt is not None:
        raise ValueError("pass either extra_keys or lora_name/cache_salt, not both")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    num_blocks = len(token_ids) // block_size
    if len(extra_keys) != num_blocks:
        raise ValueError(
            f"extra_keys has {len(extra_keys)} entries for {num_blocks} full blocks; "
            "give one entry (a tuple or None) per full block"
        )
    hash_fn = get_hash_fn(algorithm)
    parent = seed_hash(algorithm, seed)
    out: list[bytes] = []
    for i in range(num_blocks):
        block = tuple(token_ids[i * block_size : (i + 1) * block_size])
        extra = None if extra_keys[i] is None else tuple(extra_keys[i])  # type: ignore[arg-type]
        parent = hash_fn((parent, block, extra))
        out.append(parent)
    return out


@overload
def to_wire(block_hash: bytes, *, as_int: Literal[True] = ...) -> int: ...
@overload
def to_wire(block_hash: bytes, *, as_int: Literal[False]) -> bytes: ...
@overload
def to_wire(block_hash: bytes, *, as_int: bool) -> int | bytes: ...
def to_wire(block_hash: bytes, *, as_int: bool = True) -> int | bytes:
    """A block hash as it travels in events: the digest's last 8 bytes as an unsigned 64-bit
    int (vLLM's default), or the raw digest bytes when `as_int` is False."""
    if not as_int:
        return block_hash
    return int.from_bytes(block_hash[-8:], "big")
