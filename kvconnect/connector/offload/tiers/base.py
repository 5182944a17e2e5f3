"""The storage tier interface and the chunk serialisation shared by disk and redis.

Contract (called only from the worker's I/O thread, except `contains`, which any thread may
call): `put` stores a chunk and returns what it evicted (with the data, so the caller can demote
it); `get` returns the chunk's data or None if absent, and raises `TierError` if the entry is
bad (checksum) or the tier is unreachable; `remove` and `clear` return what they dropped.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import msgspec
import numpy as np
import torch
import xxhash

from kvconnect.connector.offload.common import ChunkInfo


class TierError(RuntimeError):
    """A tier could not serve a chunk (corrupt entry, server gone)."""


@dataclass
class Evicted:
    key: str
    info: ChunkInfo
    data: torch.Tensor | None


class Tier(ABC):
    kind: str
    medium: str
    shared = False  # several instances see the same entries

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


_encode = msgspec.msgpack.Encoder().encode
_decode_header = msgspec.msgpack.Decoder(_Header).decode


def pack(key: str, info: ChunkInfo, data: torch.Tensor) -> list[bytes | memoryview]:
    """[length of header (4 bytes), header, payload] without copying the payload."""
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
        )
    )
    return [len(header).to_bytes(4, "big"), header, payload]


def peek_key(blob: bytes | bytearray | memoryview) -> str:
    """The key a serialised chunk says it holds (its payload is not checked)."""
    view = memoryview(blob)
    try:
        return _decode_header(view[4 : 4 + int.from_bytes(view[:4], "big")]).key
    except (msgspec.MsgspecError, ValueError) as e:
        raise TierError(f"unreadable chunk header ({e})") from None


def unpack(
    blob: bytes | bytearray | memoryview, expected_key: str
) -> tuple[ChunkInfo, torch.Tensor]:
    """The chunk in `blob`; `TierError` if it is truncated, corrupt or another key's. A
    bytearray is used in place (the tensor shares its memory), saving a copy per load."""
    view = memoryview(blob)
    try:
        n = int.from_bytes(view[:4], "big")
        h = _decode_header(view[4 : 4 + n])
    except (msgspec.MsgspecError, ValueError) as e:
        raise TierError(f"chunk {expected_key}: unreadable header ({e})") from None
    payload = view[4 + n :]
    if h.key != expected_key:
        raise TierError(f"chunk {expected_key}: entry holds {h.key}")
    if xxhash.xxh3_64_intdigest(payload) != h.checksum:
        raise TierError(f"chunk {expected_key}: checksum mismatch")
    dtype = getattr(torch, h.dtype)
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
    )
    return info, data
