"""What both peer transports share: the verbs and their bounds, the greeting, deadlines, what a
server asks of its owner, and the checks every pulled chunk passes before anyone uses it.

    verb     argument                   answer
    HAS      msgpack [key, ...]         OK  msgpack int: how many, from the first, are held
    GET      key (ASCII)                OK  the chunk as `tiers.base.pack`'s parts | MISS
    RELEASE  lease id (ASCII)           OK  msgpack bool: whether that lease was held
    anything malformed                  ERR what was wrong (a TCP server then closes)

Every key names this rank's namespace (`rank_prefix`); a server refuses any other before it
touches a tier. A client bounds everything it reads: an answer's parts by their kind (a chunk's
payload by this rank's chunk size, anything else by `MAX_SMALL`), and its time by one
`Deadline` for the whole lookup or pull: a peer that trickles bytes or sends junk runs out of
it, however often it answers something.
"""

from __future__ import annotations

import math
import mmap
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from kvconnect.connector.offload.common import ChunkInfo
from kvconnect.connector.offload.tiers.base import (
    IntegrityError,
    StoredChunk,
    TierError,
    TierPlacement,
    mismatch,
    unpack_parts,
)

MAX_KEYS = 4096
"""Keys one HAS may name."""
MAX_KEY_BYTES = 512
MAX_LEASE_ID_BYTES = 256
MAX_REQUEST = 1 << 20
"""A request's argument (a HAS of MAX_KEYS keys fits)."""
MAX_SMALL = 4096
"""Any answer part that is not a chunk's (HELLO, HAS, RELEASE, an error)."""
REPLY_SLACK = 1 << 20
"""Bytes a chunk's parts may take beyond its payload (header, token ids, signature)."""
MAX_PARTS = 5
"""A chunk's parts (`pack`): head, header, header checksum, payload, signature."""
WINDOW = 3
"""GETs a pull keeps outstanding: the peer serialises the next chunks while one travels."""
SETTLE_POLL_S = 0.002
"""How often a held-back HAS looks again at the chunks still being stored."""

Wanted = Sequence[tuple[str, ChunkInfo]]
"""The chunks a pull asks a peer for, in order: (key, what the chunk must be)."""
Fetched = Generator[StoredChunk | TierError | None]
"""Per chunk asked: the chunk checked, None if the peer does not hold it, or why not."""

HAS, GET, RELEASE = b"HAS", b"GET", b"RELEASE"
OK, MISS, ERR = b"OK", b"MISS", b"ERR"


class Hello(msgspec.Struct, array_like=True):
    """What a server says of itself first: a client pulls only from the same rank of the
    same model at the same TP size."""

    world_size: int
    rank: int
    namespace: str


encode = msgspec.msgpack.Encoder().encode
decode_keys = msgspec.msgpack.Decoder(list[str]).decode
decode_int = msgspec.msgpack.Decoder(int).decode
decode_bool = msgspec.msgpack.Decoder(bool).decode
decode_hello = msgspec.msgpack.Decoder(Hello).decode


class Refused(Exception):
    """A request the server will not serve; its text is the ERR answer."""


class Deadline:
    """One wait's end, shared by every step of it (connect, greeting, each part read)."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds
        self.seconds = seconds

    @classmethod
    def for_bytes(cls, timeout_s: float, num_bytes: int, min_rate_mib_s: float) -> Deadline:
        """A transfer's: `timeout_s`, plus its bytes at the slowest rate allowed."""
        return cls(timeout_s + num_bytes / (min_rate_mib_s * (1 << 20)))

    def left(self) -> float:
        """Seconds left; `TimeoutError` once none are."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"its deadline of {self.seconds:g} s passed")
        return left


@dataclass(frozen=True)
class Served:
    """What a rank's server asks of its owner (the worker), from the server's threads."""

    held: Callable[[list[str]], int]
    """How many of these keys, from the first, a local tier holds (thread-safe)."""
    read: Callable[[str], list[Any] | None]
    """A chunk as `pack`'s parts (views of the tier's memory), or None if not held."""
    release: Callable[[str], bool]
    """End a lease: whether it was held."""
    settling: Callable[[list[str]], bool] = lambda _: False
    """Whether any of these keys is still on its way into a tier (a P/D prefill answers
    before its stores are done): such a HAS waits for them, up to `settle_s`."""
    settle_s: float = 0.0


def check_key(prefix: str, key: str) -> None:
    """`Refused` unless `key` is one of this rank's (`rank_prefix`)."""
    if len(key) > MAX_KEY_BYTES or not key.isascii() or not key.startswith(prefix):
        raise Refused(f"key {key[:80]!r} is not one of this rank's ({prefix}...)")


def has_keys(arg: bytes | memoryview, prefix: str) -> list[str]:
    """A HAS request's keys, checked."""
    try:
        keys = decode_keys(arg)
    except msgspec.DecodeError as e:
        raise Refused(f"HAS: not a msgpack list of keys ({e})") from None
    if len(keys) > MAX_KEYS:
        raise Refused(f"HAS: {len(keys)} keys, at most {MAX_KEYS}")
    for key in keys:
        check_key(prefix, key)
    return keys


def ascii_arg(verb: bytes, arg: bytes | memoryview, limit: int) -> str:
    """A GET's key or a RELEASE's lease id: 1 to `limit` ASCII bytes."""
    raw = bytes(arg)
    if not 0 < len(raw) <= limit or not raw.isascii():
        raise Refused(f"{verb.decode()}: its argument is 1-{limit} ASCII bytes")
    return raw.decode("ascii")


def answer_has(served: Served, keys: list[str]) -> bytes:
    """HAS's answer, once none of `keys` is settling or `settle_s` has passed (the caller's
    thread waits: a TCP connection's own, or a CURVE server's held-back queue)."""
    return encode(min(len(keys), max(0, served.held(keys))))


def check_hello(endpoint: str, hello: Hello, world_size: int, rank: int, namespace: str) -> None:
    """`ValueError` naming both if the peer runs another TP size, rank or model."""
    if hello.world_size != world_size:
        raise ValueError(
            f"peer {endpoint} runs tensor-parallel size {hello.world_size}, this instance "
            f"{world_size}: equal TP sizes only"
        )
    if hello.rank != rank or hello.namespace != namespace:
        raise ValueError(
            f"peer {endpoint} is rank {hello.rank} of model {hello.namespace!r}; asked for "
            f"rank {rank} of {namespace!r}"
        )


def checked_chunk(
    endpoint: str,
    key: str,
    asked: ChunkInfo,
    placement: TierPlacement,
    parts: Sequence[memoryview],
    mac_key: bytes | None,
) -> StoredChunk:
    """A GET's answer as the chunk `asked` describes on this rank, checked as a shared store's
    entry is (its key, checksum or signature, then tokens, hashes, parent, shape, dtype);
    `IntegrityError` naming why not."""
    try:
        info, data = unpack_parts(parts, key, mac_key)
    except IntegrityError:
        raise
    except TierError as e:
        raise IntegrityError(f"peer {endpoint}: {e}") from None
    found = StoredChunk(info, data)
    why = mismatch(asked, found, placement)
    if why is not None:
        raise IntegrityError(f"peer {endpoint}: chunk {key}: {why}")
    return found


def payload_bytes(placement: TierPlacement) -> int:
    """A whole chunk's payload on this rank."""
    return math.prod(placement.chunk_shape) * placement.dtype.itemsize


class PeerClient(ABC):
    """What a lookup or a pull asks of one rank of one peer (tcp.py's client and curve.py's):
    not thread-safe, one user (a lookup's thread, or one pull thread)."""

    endpoint: str

    @abstractmethod
    def ask(self, verb: bytes, arg: bytes, deadline: Deadline) -> bytes:
        """An OK answer's one part; `TierError` (`TierUnavailable` when the peer did not
        answer by `deadline`) for anything else."""

    @abstractmethod
    def fetch_many(
        self,
        wanted: Wanted,
        placement: TierPlacement,
        deadline: Deadline,
        sink: PayloadSink | None = None,
    ) -> Fetched:
        """Each of `wanted` in order: the chunk checked (`checked_chunk`), None if the peer
        does not hold it, or the `TierError` why not, a few requests ahead. Once the peer
        fails (or the deadline passes), every chunk left is that error."""

    @abstractmethod
    def close(self) -> None: ...

    def held_prefix(self, keys: Sequence[str], deadline: Deadline) -> int:
        """How many of `keys`, from the first, the peer holds."""
        total = 0
        for at in range(0, len(keys), MAX_KEYS):
            batch = list(keys[at : at + MAX_KEYS])
            try:
                num = decode_int(self.ask(HAS, encode(batch), deadline))
            except ValueError as e:
                raise TierError(f"peer {self.endpoint}: malformed HAS answer ({e})") from None
            num = max(0, min(num, len(batch)))
            total += num
            if num < len(batch):
                break
        return total

    def release(self, lease_id: str, deadline: Deadline) -> bool:
        """End lease `lease_id` at the peer; whether it held it."""
        try:
            return decode_bool(self.ask(RELEASE, lease_id.encode("ascii"), deadline))
        except ValueError as e:
            raise TierError(f"peer {self.endpoint}: malformed RELEASE answer ({e})") from None


class PayloadSink(Protocol):
    """Where a pull reads chunk payloads."""

    def take(self, key: str, n: int) -> memoryview | None:
        """`n` writable bytes for chunk `key`'s payload; None: memory of its own."""
        ...


class RecvBuffers:
    """Two buffers of `size` bytes, their pages populated once, that a pull reads chunk
    payloads into in turn: a chunk's data stays valid until the pull has read two more.
    Through fresh memory each 12 MB chunk cost more in first-touch page faults than in its
    copy, inside a vLLM worker (a pulled 4k-token prompt: 8,600 faults of 46,000 pages,
    ~200 ms of a 250 ms load)."""

    def __init__(self, size: int) -> None:
        populate = getattr(mmap, "MAP_POPULATE", 0)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate
        self.size = size
        self._maps = [mmap.mmap(-1, max(1, size), flags=flags) for _ in range(2)]
        self._next = 0

    def take(self, key: str, n: int) -> memoryview | None:
        if n > self.size:
            return None
        view = memoryview(self._maps[self._next])[:n]
        self._next ^= 1
        return view
