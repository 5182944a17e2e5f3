"""Chained, content-addressed block hashes, exactly as vLLM computes them.

A block's hash covers its parent's hash, its token ids and its extra keys, so it names the
whole prefix that ends with that block:

    block 0: H0 = h((NONE_HASH, tokens[0:B],  extra_0))      NONE_HASH = h(seed)
    block 1: H1 = h((H0,        tokens[B:2B], extra_1))
    block 2: H2 = h((H1,        tokens[2B:3B], extra_2))

`h` is one of vLLM's four `prefix_caching_hash_algo`s:

    sha256       SHA-256 of pickle.dumps(obj, HIGHEST_PROTOCOL)    vLLM's default
    sha256_cbor  SHA-256 of canonical CBOR                          language-independent
    xxhash       xxh3-128 of pickle.dumps(obj, HIGHEST_PROTOCOL)
    xxhash_cbor  xxh3-128 of canonical CBOR

Pickle is only ever *written* here (of ints, bytes, str, tuples and None), never read.

The seed, vLLM's resolution (`seed=None`): the `PYTHONHASHSEED` environment variable when set;
otherwise "vllm-none-hash" for the SHA-256 algorithms, so independent processes agree; otherwise
(xxhash) a random seed per process, which no other process can reproduce.

Extra keys, per block, in vLLM's order and with vLLM's tags (hashed as a tuple, None if empty):
`("lora", name, path)` on every block of a LoRA request, `("mm", identifier, offset)` per
multimodal item in the block, `("cache_salt", salt)` on the block that starts at token 0 (an
empty salt is no salt), `("prompt_embeds", digest)`. Events carry them untagged (`to_event`):
the name, `(identifier, offset)`, the salt, the digest.

On the wire (KV cache events) a hash is the last 8 digest bytes as an unsigned 64-bit int, as
vLLM sends it; `to_wire(h, as_int=False)` keeps the raw bytes.
This module imports nothing from the rest of the package.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any, Literal, overload

import cbor2
import xxhash

DEFAULT_ALGORITHM = "sha256"
"""vLLM's default `prefix_caching_hash_algo`."""
VLLM_DEFAULT_SEED = "vllm-none-hash"
"""vLLM's seed for the SHA-256 algorithms when PYTHONHASHSEED is unset."""
CRYPTOGRAPHIC_ALGORITHMS = ("sha256", "sha256_cbor")

HashFn = Callable[[Any], bytes]
ExtraKeys = tuple[Any, ...]


def _cbor(obj: Any) -> bytes:
    """Canonical CBOR of `obj`, as `cbor2.dumps(obj, canonical=True)` writes it.

    A block's `(parent, tokens, extra)` is written here, about twice as fast as cbor2 does: a
    CBOR array is its head followed by its items' encodings, and a token's encoding depends
    only on its value, so each token's bytes come from a table.
    Everything else (the seed string, unusual shapes) goes to cbor2.
    """
    if type(obj) is tuple and len(obj) == 3:
        parent, tokens, extra = obj
        if type(parent) is bytes and type(tokens) is tuple:
            try:
                body = b"".join(map(_CBOR_INTS.__getitem__, tokens))
            except TypeError:  # a token that is not a CBOR integer (cbor2 decides)
                return cbor2.dumps(obj, canonical=True)
            n, m = len(parent), len(tokens)
            return b"".join(
                (
                    b"\x83",  # array of 3
                    _BYTES_HEADS[n] if n < 256 else _cbor_head(2, n),
                    parent,
                    _ARRAY_HEADS[m] if m < 256 else _cbor_head(4, m),
                    body,
                    b"\xf6" if extra is None else cbor2.dumps(extra, canonical=True),  # nil
                )
            )
    return cbor2.dumps(obj, canonical=True)


def _cbor_head(major: int, n: int) -> bytes:
    """A CBOR item head: major type and argument `n` (0 <= n < 2**64) in the fewest bytes."""
    if n < 24:
        return bytes((major << 5 | n,))
    for extra, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes((major << 5 | extra,)) + n.to_bytes(size, "big")
    raise TypeError(f"{n} needs a CBOR bignum")


class _CborInts(dict[int, bytes]):
    """int -> its CBOR encoding, remembered for token-sized values (a vocabulary's ids)."""

    LIMIT = 1 << 18

    def __missing__(self, n: Any) -> bytes:
        # Keys are compared by value: a bool or a float equal to a cached int would read that
        # int's bytes, where cbor2 writes a CBOR bool or float. Token ids are ints (the API
        # refuses anything else), so only ints reach this table.
        if type(n) is not int:
            raise TypeError(f"not an int: {type(n).__name__}")
        encoded = _cbor_head(0, n) if n >= 0 else _cbor_head(1, -1 - n)
        if -self.LIMIT < n < self.LIMIT:
            self[n] = encoded
        return encoded


_CBOR_INTS = _CborInts()
_BYTES_HEADS = [_cbor_head(2, n) for n in range(256)]
_ARRAY_HEADS = [_cbor_head(4, n) for n in range(256)]


def sha256(obj: Any) -> bytes:
    """SHA-256 of the pickle of `obj` (32 bytes): vLLM's default block hash."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    """SHA-256 of the canonical CBOR encoding of `obj` (32 bytes)."""
    return hashlib.sha256(_cbor(obj)).digest()


def xxhash_pickle(obj: Any) -> bytes:
    """xxh3-128 of the pickle of `obj` (16 bytes): vLLM's `xxhash`."""
    return xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def xxhash_cbor(obj: Any) -> bytes:
    """xxh3-128 of the canonical CBOR encoding of `obj` (16 bytes)."""
    return xxhash.xxh3_128_digest(_cbor(obj))


HASH_FUNCTIONS: dict[str, HashFn] = {
    "sha256": sha256,
    "sha256_cbor": sha256_cbor,
    "xxhash": xxhash_pickle,
    "xxhash_cbor": xxhash_cbor,
}
ALGORITHMS = tuple(HASH_FUNCTIONS)


def get_hash_fn(algorithm: str) -> HashFn:
    """The hash function named `algorithm`; `ValueError` listing the valid names otherwise."""
    try:
        return HASH_FUNCTIONS[algorithm]
    except (KeyError, TypeError):
        valid = ", ".join(HASH_FUNCTIONS)
        raise ValueError(f"unknown hash algorithm {algorithm!r}; valid: {valid}") from None


_PROCESS_SEED = os.urandom(32).hex()  # vLLM's random seed for xxhash, one per process


def resolve_seed(algorithm: str, seed: str | None = None) -> str:
    """The seed string NONE_HASH is derived from: `seed` if given, else vLLM's rule."""
    if seed is not None:
        if not isinstance(seed, str):
            raise ValueError(f"hash seed must be a string, got {seed!r}")
        return seed
    get_hash_fn(algorithm)
    env = os.environ.get("PYTHONHASHSEED")
    if env is not None:
        return env
    return VLLM_DEFAULT_SEED if algorithm in CRYPTOGRAPHIC_ALGORITHMS else _PROCESS_SEED


def is_reproducible(algorithm: str, seed: str | None = None) -> bool:
    """Whether another process can compute the same hashes (not a random xxhash seed)."""
    return resolve_seed(algorithm, seed) != _PROCESS_SEED


@lru_cache(maxsize=64)
def _seed_hash(algorithm: str, resolved_seed: str) -> bytes:
    return get_hash_fn(algorithm)(resolved_seed)


def seed_hash(algorithm: str = DEFAULT_ALGORITHM, seed: str | None = None) -> bytes:
    """The parent hash of block 0 (vLLM's `NONE_HASH`) for this algorithm and seed."""
    return _seed_hash(algorithm, resolve_seed(algorithm, seed))


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


# -- extra keys ---------------------------------------------------------------------------------


def request_extra_keys(
    block_index: int,
    *,
    lora_name: str | None = None,
    lora_path: str | None = None,
    cache_salt: str | None = None,
) -> ExtraKeys | None:
    """The tagged extra keys of a text request's block, as vLLM hashes them."""
    keys: list[Any] = []
    if lora_name is not None:
        keys.append(("lora", lora_name, lora_path))
    if cache_salt and block_index == 0:  # "" is no salt, as in vLLM
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def to_event(extra_keys: ExtraKeys | None) -> ExtraKeys | None:
    """One block's extra keys as events carry them: untagged (vLLM's `to_event_extra_keys`)."""
    if extra_keys is None:
        return None
    return tuple(tuple(k[1:]) if k[0] == "mm" else k[1] for k in extra_keys)


def from_event(
    event_keys: Sequence[Any] | None, block_index: int, lora_name: str | None
) -> ExtraKeys | None:
    """The tagged keys vLLM hashed for a block, rebuilt from an event's untagged entry.

    Raises `ValueError` where the event does not carry enough to rebuild them: a LoRA block (its
    adapter path is hashed but not published) or an entry of no known shape.
    """
    if event_keys is None:
        return None
    if lora_name is not None:
        raise ValueError("a LoRA block's hash covers the adapter path, which events do not carry")
    keys: list[Any] = []
    for key in event_keys:
        if isinstance(key, list | tuple) and len(key) == 2:
            keys.append(("mm", key[0], key[1]))
        elif isinstance(key, str) and block_index == 0:
            keys.append(("cache_salt", key))
        elif isinstance(key, bytes):
            keys.append(("prompt_embeds", key))
        else:
            raise ValueError(f"extra key {key!r} of block {block_index} has no known shape")
    return tuple(keys) if keys else None


# -- chains ------------------------------------------------------------------------------------


def _check_block_size(block_size: object) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")


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
        lora_path: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        _check_block_size(block_size)
        self.block_size = block_size
        self._hash_fn = get_hash_fn(algorithm)
        self._parent = seed_hash(algorithm, seed)
        # Block 0 may carry the salt; every later block has the same keys (the LoRA one).
        self._first_extra = request_extra_keys(
            0, lora_name=lora_name, lora_path=lora_path, cache_salt=cache_salt
        )
        self._later_extra = request_extra_keys(1, lora_name=lora_name, lora_path=lora_path)
        self._pending: list[int] = []
        self.block_hashes: list[bytes] = []

    @property
    def num_tokens(self) -> int:
        return len(self.block_hashes) * self.block_size + len(self._pending)

    def extra_keys(self, block_index: int) -> ExtraKeys | None:
        """The tagged extra keys of block `block_index` of this request."""
        return self._first_extra if block_index == 0 else self._later_extra

    def append(self, token_ids: Sequence[int]) -> list[bytes]:
        """Add tokens; return the hashes of the blocks that became full."""
        pending = self._pending
        pending.extend(token_ids)
        new: list[bytes] = []
        bs, hash_fn, hashes = self.block_size, self._hash_fn, self.block_hashes
        parent = self._parent
        start = 0
        while len(pending) - start >= bs:
            block = tuple(pending[start : start + bs])
            extra = self._later_extra if hashes else self._first_extra
            parent = hash_fn((parent, block, extra))
            hashes.append(parent)
            new.append(parent)
            start += bs
        self._parent = parent
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
    parent_hash: bytes | None = None,
    lora_name: str | None = None,
    lora_path: str | None = None,
    cache_salt: str | None = None,
) -> list[bytes]:
    """Chained hashes of every full block of `token_ids`.

    Extra keys come either from `lora_name`/`lora_path`/`cache_salt` (the request form) or
    explicitly: one tagged entry (a tuple or None) per full block. `parent_hash` continues a
    chain (the tokens then start at a block boundary after it).
    """
    if extra_keys is None and parent_hash is None:
        hasher = RequestBlockHasher(
            block_size,
            algorithm=algorithm,
            seed=seed,
            lora_name=lora_name,
            lora_path=lora_path,
            cache_salt=cache_salt,
        )
        return hasher.append(token_ids)
    if extra_keys is not None and (lora_name is not None or cache_salt is not None):
        raise ValueError("pass either extra_keys or lora_name/cache_salt, not both")
    _check_block_size(block_size)
    num_blocks = len(token_ids) // block_size
    if extra_keys is not None and len(extra_keys) != num_blocks:
        raise ValueError(
            f"extra_keys has {len(extra_keys)} entries for {num_blocks} full blocks; "
            "give one entry (a tuple or None) per full block"
        )
    hash_fn = get_hash_fn(algorithm)
    parent = parent_hash or seed_hash(algorithm, seed)
    out: list[bytes] = []
    for i in range(num_blocks):
        block = tuple(token_ids[i * block_size : (i + 1) * block_size])
        if extra_keys is not None:
            keys = extra_keys[i]
            extra = None if keys is None else tuple(keys)
        else:  # a continued request chain: its later blocks carry only the LoRA key
            extra = request_extra_keys(1, lora_name=lora_name, lora_path=lora_path)
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
