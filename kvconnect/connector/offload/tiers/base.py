"""The storage tier interface and the chunk serialisation shared by disk and redis.

Contract. A worker's tiers are called only from its I/O thread, except `contains`, which any
thread may call:
- `put` stores a chunk and returns what it evicted (with the data, so the caller can demote it);
- `get` returns the chunk's data or None if absent, and raises `TierError` if the entry is bad
  (checksum) or the tier is unreachable; `remove` and `clear` return what they dropped;
- `num_held_prefix(chunks)` answers, for chunks given as their per-rank keys, how many from the
  first the tier holds on every rank (the scheduler half asks shared tiers this, off its step
  thread); `TierError` if the tier cannot be asked;
- `check_integrity()` raises AssertionError if the tier's own bookkeeping is inconsistent;
- `watch_removals(...)` (the scheduler half, once, on its shared tier) returns what follows the
  entries the tier drops on its own, or None if there is nothing to follow.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, Self

import msgspec
import numpy as np
import torch
import xxhash

from kvconnect.connector.offload.common import ChunkInfo, TierConfig
from kvconnect.connector.offload.kinds import TierKind
from kvconnect.events import ExternalBlockHash


class TierError(RuntimeError):
    """A tier could not serve a chunk (corrupt entry, server gone)."""


class TierTooSmall(ValueError):
    """A tier's budget holds no chunk of this engine's size: the worker runs without it."""


@dataclass
class Evicted:
    key: str
    info: ChunkInfo
    data: torch.Tensor | None


@dataclass(frozen=True)
class TierPlacement:
    """Where a tier instance lives and what its chunks look like."""

    world_size: int
    rank: int
    """The worker's TP rank (0 for the scheduler half, which holds no chunk data)."""
    chunk_shape: tuple[int, ...] = ()
    """[num_layers, 2, chunk_size, kv_heads / tp, head_dim]; empty in the scheduler half."""
    dtype: torch.dtype = torch.float32


class RemovalWatcher(Protocol):
    """Follows what a shared tier drops on its own (evictions, expiries), for the chunks the
    scheduler half announced there; runs its own thread (see tiers/redis_watch.py)."""

    def announce(self, last_block_hash: bytes, block_hashes: Sequence[ExternalBlockHash]) -> None:
        """The chunk's BlockStored was released: follow it from now on."""

    def take_removed(self) -> list[tuple[bytes, list[ExternalBlockHash]]]:
        """The chunks dropped since the last call, (last block hash, block hashes), once each."""

    @property
    def has_removed(self) -> bool:
        """Whether `take_removed` has something."""

    def shutdown(self) -> None: ...


RankKeys = Callable[[bytes], list[str]]
"""A chunk's keys on every rank, from the hash of its last block."""


class Tier(ABC):
    kind: ClassVar[TierKind]
    """What the tier is (its config's `kind`); its medium and sharing follow from it."""

    @property
    def medium(self) -> str:
        """Its medium in KV events."""
        return self.kind.medium

    @property
    def shared(self) -> bool:
        """Several instances see the same entries."""
        return self.kind.shared

    @classmethod
    @abstractmethod
    def from_config(cls, config: TierConfig, placement: TierPlacement) -> Self: ...

    @abstractmethod
    def contains(self, key: str) -> bool: ...

    @abstractmethod
    def put(self, key: str, info: ChunkInfo, data: torch.Tensor) -> list[Evicted]: ...

    @abstractmethod
    def get(self, key: str) -> torch.Tensor | None: ...

    @abstractmethod
    def remove(self, key: str) -> ChunkInfo | None: ...

    @abstractmethod
    def clear(self) -> list[tuple[str, ChunkInfo]]: ...

    def entries(self) -> list[tuple[str, ChunkInfo]]:
        """What the tier holds (a disk tier finds its entries again after a restart)."""
        return []

    def num_held_prefix(self, chunks: Sequence[Sequence[str]]) -> int:
        """How many of `chunks` (each its per-rank keys), from the first, are held whole."""
        num = 0
        while num < len(chunks) and all(self.contains(k) for k in chunks[num]):
            num += 1
        return num

    @abstractmethod
    def check_integrity(self) -> None: ...

    def check_reachable(self) -> None:
        """`ValueError` if the tier cannot be used at all (a remote one that does not answer);
        local tiers always can."""
        return None

    def watch_removals(
        self, key_prefix: str, world_size: int, rank_keys: RankKeys
    ) -> RemovalWatcher | None:
        """What follows the entries this tier drops without being asked (`key_prefix` starts
        the keys of this model and world size). None, the default: a tier that drops only what
        it is asked to, or reports its evictions itself (local tiers return them from `put`)."""
        return None

    def close(self) -> None:
        return None


class _Header(msgspec.Struct, array_like=True):
    key: str
    last_block_hash: bytes
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    dtype: str
    shape: list[int]
    checksum: int
    extra_keys: list[Any] | None = None


MAGIC = b"KVC2"
"""First bytes of a serialised chunk: the format and its version (an older file is unreadable,
so it is dropped and recomputed, never misread)."""
DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int8", "uint8", "float8_e4m3fn")
}
"""The dtypes a chunk may name: a header is never turned into an arbitrary torch attribute."""
_encode = msgspec.msgpack.Encoder().encode
_decode_header = msgspec.msgpack.Decoder(_Header).decode
_PREFIX = len(MAGIC) + 4  # magic, header length
_SUM = 8  # the header's own checksum follows it


def pack(key: str, info: ChunkInfo, data: torch.Tensor) -> list[bytes | memoryview]:
    """[magic and header length, header, header checksum, payload] without copying the
    payload. The header names the payload's checksum; both checksums are xxh3-64."""
    payload = data.contiguous().view(torch.uint8).reshape(-1).numpy().data
    header = _encode(
        _Header(
            key,
            info.last_block_hash,
            list(info.block_hashes),
            info.parent_block_hash,
            list(info.token_ids),
            info.block_size,
            str(data.dtype).removeprefix("torch."),
            list(data.shape),
            xxhash.xxh3_64_intdigest(payload),
            None if info.extra_keys is None else list(info.extra_keys),
        )
    )
    head = MAGIC + len(header).to_bytes(4, "big")
    return [head, header, xxhash.xxh3_64_digest(header), payload]


def _header(view: memoryview) -> tuple[_Header, int]:
    """The checked header of a serialised chunk and where its payload starts."""
    if len(view) < _PREFIX or view[: len(MAGIC)] != MAGIC:
        raise TierError("not a kvconnect chunk (bad magic)")
    n = int.from_bytes(view[len(MAGIC) : _PREFIX], "big")
    end = _PREFIX + n
    if end + _SUM > len(view):
        raise TierError(f"truncated ({len(view)} bytes, header says {n})")
    raw = view[_PREFIX:end]
    if xxhash.xxh3_64_digest(raw) != view[end : end + _SUM]:
        raise TierError("header checksum mismatch")
    try:
        h = _decode_header(raw)
    except (msgspec.MsgspecError, ValueError) as e:
        raise TierError(f"unreadable header ({e})") from None
    return h, end + _SUM


def peek_key(blob: bytes | bytearray | memoryview) -> str:
    """The key a serialised chunk says it holds (its header is checked, its payload not)."""
    return _header(memoryview(blob))[0].key


def unpack(
    blob: bytes | bytearray | memoryview, expected_key: str
) -> tuple[ChunkInfo, torch.Tensor]:
    """The chunk in `blob`; `TierError` if it is truncated, corrupt, inconsistent or another
    key's. A bytearray is used in place (the tensor shares its memory), saving a copy per load."""
    view = memoryview(blob)
    try:
        h, start = _header(view)
    except TierError as e:
        raise TierError(f"chunk {expected_key}: {e}") from None
    payload = view[start:]
    if h.key != expected_key:
        raise TierError(f"chunk {expected_key}: entry holds {h.key}")
    if xxhash.xxh3_64_intdigest(payload) != h.checksum:
        raise TierError(f"chunk {expected_key}: checksum mismatch")
    dtype = DTYPES.get(h.dtype)
    numel = 1
    for dim in h.shape:
        numel *= dim
    if dtype is None or any(d < 0 for d in h.shape) or numel * dtype.itemsize != len(payload):
        raise TierError(
            f"chunk {expected_key}: dtype {h.dtype!r} and shape {h.shape} do not describe "
            f"its {len(payload)} payload bytes"
        )
    if h.block_size <= 0 or len(h.token_ids) != len(h.block_hashes) * h.block_size:
        raise TierError(f"chunk {expected_key}: its blocks and tokens disagree")
    array = np.frombuffer(payload, dtype=np.uint8)
    # A bytearray we own is used in place; immutable bytes (redis) cost one copy.
    raw = torch.from_numpy(array if array.flags.writeable else array.copy())
    data = raw.view(dtype).reshape(h.shape)
    info = ChunkInfo(
        h.last_block_hash,
        tuple(h.block_hashes),
        h.parent_block_hash,
        tuple(h.token_ids),
        h.block_size,
        None if h.extra_keys is None else tuple(_keys(k) for k in h.extra_keys),
    )
    return info, data


def _keys(block_keys: Any) -> tuple[Any, ...] | None:
    """One block's extra keys as stored (a list, or null) back to the tuple it was."""
    if block_keys is None:
        return None
    if not isinstance(block_keys, list):
        raise TierError(f"extra keys {block_keys!r} are not a list")
    return tuple(block_keys)
