"""The storage tier interface and the chunk serialisation shared by disk and redis.

Contract. A worker calls a local tier (cpu, disk) from several threads, each call under that
tier's own lock, and a shared tier (redis) without one (worker.py says which threads);
`contains` any thread may call without the lock:
- `put` stores a chunk and returns what it evicted (with the data, so the caller can demote it);
- `load` returns the chunk as stored (its header's description and its data) or None if
  absent, and raises `TierError` if the entry is bad (checksum, signature: `IntegrityError`) or
  the tier is unreachable (`TierUnavailable`: a remote tier backing off did not even try);
  `get` is its data alone; `remove` and `clear` return what they dropped. Whether what was
  loaded is what was asked for (tokens, hashes, shape) the worker checks, the same way for
  every tier (worker.py);
- `num_held_prefix(chunks)` answers, for chunks given as their per-rank keys, how many from the
  first the tier holds on every rank (the scheduler half asks shared tiers this, off its step
  thread); `TierError` if the tier cannot be asked;
- `check_integrity()` raises AssertionError if the tier's own bookkeeping is inconsistent;
- `watch_removals(...)` (the scheduler half, once, on its shared tier) returns what follows the
  entries the tier drops on its own, or None if there is nothing to follow.
"""

from __future__ import annotations

import hmac
import os
import stat
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, Self

import msgspec
import numpy as np
import torch
import xxhash

from kvconnect.config import check_secret_mode
from kvconnect.connector.offload.common import ChunkInfo, TierConfig
from kvconnect.connector.offload.kinds import TierKind
from kvconnect.events import ExternalBlockHash


class TierError(RuntimeError):
    """A tier could not serve a chunk (corrupt entry, server gone)."""


class TierUnavailable(TierError):
    """A remote tier backing off after its server stopped answering (tiers/backoff.py): the
    operation was not tried, so it failed at no cost."""


class IntegrityError(TierError):
    """An entry that is not what its key promises: unsigned or wrongly signed under a
    deployment key, or describing another chunk or shape than the one asked for."""


class TierTooSmall(ValueError):
    """A tier's budget holds no chunk of this engine's size: the worker runs without it."""


@dataclass
class Evicted:
    key: str
    info: ChunkInfo
    data: torch.Tensor | None


@dataclass(frozen=True)
class StoredChunk:
    """A chunk as a tier returned it: what its entry says it is, and its data."""

    info: ChunkInfo
    data: torch.Tensor


@dataclass(frozen=True)
class TierPlacement:
    """Where a tier instance lives and what its chunks look like."""

    world_size: int
    rank: int
    """The worker's TP rank (0 for the scheduler half, which holds no chunk data)."""
    chunk_shape: tuple[int, ...] = ()
    """[num_layers, planes, chunk_size, heads / tp, dim] (layout.py); empty in the scheduler
    half."""
    dtype: torch.dtype = torch.float32
    namespace: str = ""
    """The chunk keys' model namespace (`common.key_namespace`): a disk tier's directory."""


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
    def load(self, key: str) -> StoredChunk | None: ...

    def get(self, key: str) -> torch.Tensor | None:
        """The data of `load(key)`."""
        chunk = self.load(key)
        return None if chunk is None else chunk.data

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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
    tag_len: int
    """Bytes of signature after the payload (0: unsigned)."""
    extra_keys: list[Any] | None = None


MAGIC = b"KVC3"
"""First bytes of a serialised chunk: the format and its version (an older file is unreadable,
so it is skipped and recomputed, never misread)."""
DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int8", "uint8", "float8_e4m3fn")
}
"""The dtypes a chunk may name: a header is never turned into an arbitrary torch attribute."""
_encode = msgspec.msgpack.Encoder().encode
_decode_header = msgspec.msgpack.Decoder(_Header).decode
_PREFIX = len(MAGIC) + 4  # magic, header length
_SUM = 8  # the header's own checksum follows it
MAC = "sha256"
"""The signature: HMAC-SHA256 over header and payload (hashlib's SHA-256 is the fastest keyed
construction the standard library has here: ~1 GB/s, blake2b ~0.5 GB/s, measured)."""
TAG_LEN = 32


def _tag(mac_key: bytes, header: bytes | memoryview, payload: bytes | memoryview) -> bytes:
    mac = hmac.new(mac_key, header, MAC)
    mac.update(payload)
    return mac.digest()


def pack(
    key: str, info: ChunkInfo, data: torch.Tensor, mac_key: bytes | None = None
) -> list[bytes | memoryview]:
    """[magic and header length, header, header checksum, payload, signature] without copying
    the payload. The header names the payload's checksum (both checksums are xxh3-64, against
    accidents); with `mac_key` the chunk ends in its HMAC (against a writer without the key)."""
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
            0 if mac_key is None else TAG_LEN,
            None if info.extra_keys is None else list(info.extra_keys),
        )
    )
    head = MAGIC + len(header).to_bytes(4, "big")
    parts: list[bytes | memoryview] = [head, header, xxhash.xxh3_64_digest(header), payload]
    if mac_key is not None:
        parts.append(_tag(mac_key, header, payload))
    return parts


def _header(view: memoryview, total: int | None = None) -> tuple[_Header, memoryview, int]:
    """The checked header of a serialised chunk, its bytes, and where its payload starts
    (`total`: the whole chunk's length, when `view` holds only its front)."""
    total = len(view) if total is None else total
    if len(view) < _PREFIX or view[: len(MAGIC)] != MAGIC:
        raise TierError("not a kvconnect chunk (bad magic)")
    n = int.from_bytes(view[len(MAGIC) : _PREFIX], "big")
    end = _PREFIX + n
    if end + _SUM > len(view):
        raise TierError(f"truncated ({total} bytes, header says {n})")
    raw = view[_PREFIX:end]
    if xxhash.xxh3_64_digest(raw) != view[end : end + _SUM]:
        raise TierError("header checksum mismatch")
    try:
        h = _decode_header(raw)
    except (msgspec.MsgspecError, ValueError) as e:
        raise TierError(f"unreadable header ({e})") from None
    if h.tag_len not in (0, TAG_LEN) or end + _SUM + h.tag_len > total:
        raise TierError(f"bad signature length {h.tag_len}")
    return h, raw, end + _SUM


def peek_key(blob: bytes | bytearray | memoryview) -> str:
    """The key a serialised chunk says it holds (its header is checked, its payload not)."""
    return _header(memoryview(blob))[0].key


def unpack(
    blob: bytes | bytearray | memoryview, expected_key: str, mac_key: bytes | None = None
) -> tuple[ChunkInfo, torch.Tensor]:
    """The chunk in `blob`; `TierError` if it is truncated, corrupt, inconsistent or another
    key's; with `mac_key`, `IntegrityError` unless it is signed with that key (compared in
    constant time). A bytearray is used in place (the tensor shares its memory), saving a copy
    per load."""
    view = memoryview(blob)
    try:
        h, raw, start = _header(view)
    except TierError as e:
        raise TierError(f"chunk {expected_key}: {e}") from None
    tag = view[len(view) - h.tag_len :]
    return _checked(h, raw, view[start : len(view) - h.tag_len], tag, expected_key, mac_key)


def unpack_parts(
    parts: Sequence[memoryview], expected_key: str, mac_key: bytes | None = None
) -> tuple[ChunkInfo, torch.Tensor]:
    """`unpack` of a chunk that came as `pack`'s parts (a peer's frames): the same checks;
    the payload's own buffer, when writable, becomes the tensor's memory (no copy)."""
    if len(parts) not in (4, 5):
        raise TierError(f"chunk {expected_key}: {len(parts)} parts, not a chunk's 4 or 5")
    front = memoryview(b"".join(parts[:3]))
    payload, tag = memoryview(parts[3]), memoryview(parts[4] if len(parts) == 5 else b"")
    try:
        h, raw, start = _header(front, len(front) + len(payload) + len(tag))
    except TierError as e:
        raise TierError(f"chunk {expected_key}: {e}") from None
    if start != len(front) or h.tag_len != len(tag):
        raise TierError(f"chunk {expected_key}: its parts do not frame a chunk")
    return _checked(h, raw, payload, tag, expected_key, mac_key)


def _checked(
    h: _Header,
    raw: memoryview,
    payload: memoryview,
    tag: memoryview,
    expected_key: str,
    mac_key: bytes | None,
) -> tuple[ChunkInfo, torch.Tensor]:
    if mac_key is not None:  # the signature covers the payload: no checksum needed
        if not h.tag_len:
            raise IntegrityError(f"chunk {expected_key}: unsigned (a deployment key is set)")
        if not hmac.compare_digest(_tag(mac_key, raw, payload), tag):
            raise IntegrityError(f"chunk {expected_key}: wrong signature")
    elif xxhash.xxh3_64_intdigest(payload) != h.checksum:
        raise TierError(f"chunk {expected_key}: checksum mismatch")
    if h.key != expected_key:
        raise TierError(f"chunk {expected_key}: entry holds {h.key}")
    return _info(h, expected_key, len(payload)), _tensor(payload, h)


def _info(h: _Header, expected_key: str, num_bytes: int) -> ChunkInfo:
    """What the checked header describes; `TierError` if it contradicts itself."""
    dtype = DTYPES.get(h.dtype)
    numel = 1
    for dim in h.shape:
        numel *= dim
    if dtype is None or any(d < 0 for d in h.shape) or numel * dtype.itemsize != num_bytes:
        raise TierError(
            f"chunk {expected_key}: dtype {h.dtype!r} and shape {h.shape} do not describe "
            f"its {num_bytes} payload bytes"
        )
    if h.block_size <= 0 or len(h.token_ids) != len(h.block_hashes) * h.block_size:
        raise TierError(f"chunk {expected_key}: its blocks and tokens disagree")
    return ChunkInfo(
        h.last_block_hash,
        tuple(h.block_hashes),
        h.parent_block_hash,
        tuple(h.token_ids),
        h.block_size,
        None if h.extra_keys is None else tuple(_keys(k) for k in h.extra_keys),
    )


def _tensor(payload: memoryview, h: _Header) -> torch.Tensor:
    array = np.frombuffer(payload, dtype=np.uint8)
    # A bytearray we own is used in place; immutable bytes (redis) cost one copy.
    raw = torch.from_numpy(array if array.flags.writeable else array.copy())
    return raw.view(DTYPES[h.dtype]).reshape(h.shape)


def _keys(block_keys: Any) -> tuple[Any, ...] | None:
    """One block's extra keys as stored (a list, or null) back to the tuple it was."""
    if block_keys is None:
        return None
    if not isinstance(block_keys, list):
        raise TierError(f"extra keys {block_keys!r} are not a list")
    return tuple(block_keys)


def mismatch(asked: ChunkInfo, found: StoredChunk, placement: TierPlacement) -> str | None:
    """Why `found` is not the chunk the scheduler asked to load into this rank's cache (None:
    it is). Keys name only the last block's hash: the entry itself must also agree."""
    got = found.info
    if got.token_ids != asked.token_ids:
        return "its token ids differ"
    if got.block_hashes != asked.block_hashes or got.last_block_hash != asked.last_block_hash:
        return "its block hashes differ"
    if got.parent_block_hash != asked.parent_block_hash or got.block_size != asked.block_size:
        return "its parent hash or block size differs"
    data, shape = found.data, tail_shape(placement.chunk_shape, len(asked.token_ids))
    if tuple(data.shape) != shape or data.dtype != placement.dtype:
        return (
            f"a {data.dtype} chunk of shape {tuple(data.shape)}, not this engine's "
            f"{placement.dtype} {shape}"
        )
    return None


def tail_shape(chunk_shape: tuple[int, ...], num_tokens: int) -> tuple[int, ...]:
    """The shape of a chunk of `num_tokens` (a whole chunk's, or a tail's: fewer blocks)."""
    return (*chunk_shape[:2], num_tokens, *chunk_shape[3:])


MIN_KEY_BYTES = 16


def read_secret(path: str, field: str, min_bytes: int = 1) -> bytes:
    """The secret in the file `path` (a tier's `field`), surrounding whitespace stripped;
    `ValueError` naming the field and what is wrong: missing, unreadable, shorter than
    `min_bytes`, or open to group or others (`check_secret_mode`). Read from the file it
    checked (fstat on the open descriptor): a swap between check and read changes nothing."""
    where = f"{field} {path!r}"
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise ValueError(f"{where}: cannot be opened ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{where}: not a regular file")
        check_secret_mode(where, st.st_mode)
        secret = os.read(fd, 1 << 16).strip()
    finally:
        os.close(fd)
    if len(secret) < min_bytes:
        raise ValueError(
            f"{where}: holds {len(secret)} bytes, needs at least {min_bytes} "
            f"(e.g. head -c 32 /dev/urandom | base64 > {path})"
        )
    return secret


def read_mac_key(path: str) -> bytes:
    """The deployment key of a tier's `hmac_key_file` (at least 16 bytes; see read_secret)."""
    return read_secret(path, "hmac_key_file", MIN_KEY_BYTES)
