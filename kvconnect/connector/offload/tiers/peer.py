"""The peer tier's transport: one rank serves the chunks of its local tiers to the same rank
of other instances, and pulls chunks from theirs (issue 32; design.md, "Moving KV").

Over ZMQ: a ROUTER per serving rank, a DEALER per (source, rank) pulling. Every message is
[request id (8 bytes), verb, argument]; every answer [request id, status, payload]:

    HELLO  -                      OK  msgpack {world_size, rank, namespace}
    HAS    msgpack [key, ...]     OK  msgpack int: how many, from the first, are held
    GET    key                    OK  the chunk as tiers.base.pack's parts | MISS
    RELEASE lease id (ASCII)      OK  msgpack bool: whether that lease was held (P/D: a
                                  decode instance has pulled what it leased; leases.py)
    any malformed request         ERR what was wrong (the server serves on)

The server never touches a tier: its owner answers through `held(keys)` (thread-safe:
`contains`) and `read(key)` (thread-safe: under the owner's tiers' lock, never queued behind
its I/O thread's pulls). What the client takes is
checked as a shared store's entry is before anyone uses it: `unpack` (the key it names, its
checksums, its HMAC where a key is set), then `mismatch` against the chunk asked for (token
ids, block hashes, parent, block size, shape, dtype). A reply over the chunk's size is refused
by ZMQ itself (MAXMSGSIZE); a silent peer costs `timeout_s`, after which the socket is
replaced, so a late answer is never taken for the next one.

With `curve_secret_key_file` in the peer config, every peer socket runs CurveZMQ with one
certificate the deployment shares (`shared_curve`): a peer without it completes no
handshake, so it neither reads chunks nor learns which prefixes are held.

Without CURVE, the chunks of a pull (`fetch_many`) travel over a plain TCP connection of
their own, the *data port* (HELLO's `data_port`, on the server's host; 0: none):

    request   4-byte length, key (ASCII)             one after another, answered in order
    answer    status (b"K" chunk, b"M" miss, b"E" error), part count (1 byte),
              8-byte length per part, the parts      (a chunk's parts: `pack`'s)

The client reads a chunk's payload straight into memory it keeps populated (`RecvBuffers`),
one copy from the kernel and no allocation: through ZMQ every 12 MB chunk landed in a new
allocation whose first-touch page faults cost more than its copy, inside a vLLM worker (a
pulled 4k-token prompt: 8,600 faults of 46,000 pages moved, ~200 ms of a 250 ms load).
The data port checks what the ROUTER checks (a key of this rank, bounded), answers ERR and
closes on anything else, and holds at most MAX_DATA_CONNECTIONS connections.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any, Protocol

import msgspec
import zmq

from kvconnect.connector.offload.common import ChunkInfo, rank_prefix
from kvconnect.connector.offload.tiers.base import (
    IntegrityError,
    StoredChunk,
    TierError,
    TierPlacement,
    TierUnavailable,
    mismatch,
    unpack,
    unpack_parts,
)
from kvconnect.stream.curve import CurveClientKeys, CurveServerKeys

logger = logging.getLogger(__name__)

MAX_KEYS = 4096
"""Keys one HAS may name."""
MAX_KEY_BYTES = 512
REPLY_SLACK = 1 << 20
"""Bytes a chunk's serialised form may take beyond its payload (header, token ids, tag)."""
WINDOW = 3
"""GETs a pull keeps outstanding (`fetch_many`)."""
MAX_LEASE_ID_BYTES = 256
MAX_DEFERRED = 1024
"""HAS requests one server holds back at once (waiting for chunks still being stored); beyond
that one is answered at once with what is held."""
SETTLE_POLL_MS = 2
"""How often held-back HAS requests are looked at again."""
MAX_DATA_CONNECTIONS = 64
"""Data-port connections one rank's server holds at once; more are closed at once."""
MAX_PARTS = 5
"""A chunk's parts (`pack`): head, header, header checksum, payload, signature."""
HELLO, HAS, GET, RELEASE = b"HELLO", b"HAS", b"GET", b"RELEASE"
DATA_CHUNK, DATA_MISS, DATA_ERR = b"K", b"M", b"E"
OK, MISS, ERR = b"OK", b"MISS", b"ERR"

Held = Callable[[list[str]], int]
Settling = Callable[[list[str]], bool]
"""Whether any of these keys is still on its way into a tier (its store queued)."""
_HeldBack = tuple[float, bytes, bytes, list[str]]
"""A HAS answered later: (deadline, identity, request id, keys)."""
Read = Callable[[str], list[Any] | None]
"""A chunk as `tiers.base.pack`'s parts (bytes or buffers, sent as frames without a copy)."""
Release = Callable[[str], bool]


class _Hello(msgspec.Struct, array_like=True):
    world_size: int
    rank: int
    namespace: str
    data_port: int = 0
    """Where chunks are served over plain TCP (0: over ZMQ only, as with CURVE)."""


_keys = msgspec.msgpack.Decoder(list[str])
_int = msgspec.msgpack.Decoder(int)
_bool = msgspec.msgpack.Decoder(bool)
_hello = msgspec.msgpack.Decoder(_Hello)
_encode = msgspec.msgpack.Encoder().encode


def shared_curve(secret_key_file: str) -> tuple[CurveServerKeys, CurveClientKeys] | None:
    """The CURVE keys of a deployment's one peer certificate (a ZMQ certificate with its
    secret key, mode 0600; stream/curve.py makes one): every instance serves with it and
    pulls with it. None without a file; ValueError naming the file if it is unfit."""
    if not secret_key_file:
        return None
    server = CurveServerKeys.from_file(secret_key_file)
    return server, CurveClientKeys(server.public, server.public, server.secret)


class PeerServer:
    """One rank's server, on its own thread, bound at `endpoint` (loopback by default: the
    peer config's host). `close()` stops it."""

    def __init__(
        self,
        endpoint: str,
        world_size: int,
        rank: int,
        namespace: str,
        held: Held,
        read: Read,
        release: Release | None = None,
        curve: CurveServerKeys | None = None,
        settling: Settling | None = None,
        settle_s: float = 0.0,
    ) -> None:
        """`release(lease_id)`: end a lease (None: RELEASE always answers False). `curve`:
        serve CurveZMQ only (`shared_curve`). A HAS naming a key that is `settling` is
        answered once none is, or after `settle_s` (a P/D prefill answers before its stores
        are done); meanwhile the server answers everything else."""
        self.held, self.read = held, read
        self.release = release or (lambda _: False)
        self.settling = settling or (lambda _: False)
        self.settle_s = settle_s
        self._deferred: deque[_HeldBack] = deque()
        self._prefix = rank_prefix(namespace, world_size, rank)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 256)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)  # requests: keys, never chunks
        if curve is not None:
            curve.apply(self._sock)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as e:
            self._sock.close()
            raise ValueError(f"peer: cannot serve on {endpoint}: {e}") from None
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.data: _DataServer | None = None
        if curve is None:  # the data port has no encryption: only where ZMQ's has none
            host = _host(self.endpoint)
            try:
                self.data = _DataServer(host, self._serve_data)
            except OSError as e:
                self._sock.close()
                raise ValueError(f"peer: cannot serve chunks on {host}: {e}") from None
        data_port = self.data.port if self.data is not None else 0
        self._hello = _encode(_Hello(world_size, rank, namespace, data_port))
        self._wake_addr = f"inproc://kvconnect-peer-{id(self)}-{os.getpid()}"
        self._wake = self._ctx.socket(zmq.PAIR)
        self._wake.bind(self._wake_addr)
        self.num_refused = 0
        self._thread = threading.Thread(target=self._run, name="kv-peer-server", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(SETTLE_POLL_MS if self._deferred else None))
                if self._wake in ready:
                    return
                while True:
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=True)
                    except zmq.Again:
                        break
                    self._answer(frames)
                if self._deferred:
                    self._answer_settled()
        finally:
            self._sock.close(0)
            self._wake.close(0)

    def _answer(self, frames: list[bytes]) -> None:
        identity, rest = frames[0], frames[1:]
        if len(rest) != 3 or len(rest[0]) != 8:
            self.num_refused += 1
            if rest and len(rest[0]) == 8:
                self._send(identity, rest[0], ERR, b"a request is [id, verb, argument]")
            return  # no request id to answer under
        rid, verb, arg = rest
        payload: list[Any]
        try:
            answer = self._handle(identity, rid, verb, arg)
            if answer is None:  # held back, answered by _answer_settled
                return
            status, payload = answer
        except _Refused as e:
            self.num_refused += 1
            status, payload = ERR, [str(e).encode()]
        except Exception:  # the owner's callback failed: a miss, never a dead server
            logger.exception("peer: serving %r failed", verb)
            status, payload = ERR, [b"the server failed to read it"]
        self._send(identity, rid, status, *payload)

    def _send(self, identity: bytes, rid: bytes, status: bytes, *payload: Any) -> None:
        with contextlib.suppress(zmq.ZMQError):  # the peer is gone or not reading
            self._sock.send_multipart([identity, rid, status, *payload], zmq.NOBLOCK, copy=False)

    def _handle(
        self, identity: bytes, rid: bytes, verb: bytes, arg: bytes
    ) -> tuple[bytes, list[Any]] | None:
        if verb == HELLO:
            return OK, [self._hello]
        if verb == HAS:
            try:
                keys = _keys.decode(arg)
            except msgspec.DecodeError as e:
                raise _Refused(f"HAS: not a msgpack list of keys ({e})") from None
            if len(keys) > MAX_KEYS:
                raise _Refused(f"HAS: {len(keys)} keys, at most {MAX_KEYS}")
            for key in keys:
                self._check_key(key)
            if len(self._deferred) < MAX_DEFERRED and self.settle_s > 0 and self.settling(keys):
                self._deferred.append((time.monotonic() + self.settle_s, identity, rid, keys))
                return None
            return OK, [self._num_held(keys)]
        if verb == GET:
            try:
                key = arg.decode("ascii")
            except UnicodeDecodeError:
                raise _Refused("GET: a key is ASCII") from None
            self._check_key(key)
            found = self.read(key)
            return (MISS, [b""]) if found is None else (OK, found)
        if verb == RELEASE:
            if not 0 < len(arg) <= MAX_LEASE_ID_BYTES or not arg.isascii():
                raise _Refused(f"RELEASE: a lease id is 1-{MAX_LEASE_ID_BYTES} ASCII bytes")
            return OK, [_encode(bool(self.release(arg.decode("ascii"))))]
        raise _Refused(f"unknown verb {verb[:16]!r} (HELLO, HAS, GET, RELEASE)")

    def _num_held(self, keys: list[str]) -> bytes:
        return _encode(min(len(keys), max(0, self.held(keys))))

    def _answer_settled(self) -> None:
        """Answer the held-back HAS requests whose keys are all stored, or whose time is up."""
        now, waiting = time.monotonic(), deque[_HeldBack]()
        for deadline, identity, rid, keys in self._deferred:
            try:
                if now < deadline and self.settling(keys):
                    waiting.append((deadline, identity, rid, keys))
                    continue
                status, payload = OK, self._num_held(keys)
            except Exception:  # the owner's callback failed: a miss, never a dead server
                logger.exception("peer: serving HAS failed")
                status, payload = ERR, b"the server failed to read it"
            self._send(identity, rid, status, payload)
        self._deferred = waiting

    def _check_key(self, key: str) -> None:
        if len(key) > MAX_KEY_BYTES or not key.isascii() or not key.startswith(self._prefix):
            raise _Refused(f"key {key[:80]!r} is not one of this rank's ({self._prefix}...)")

    def _serve_data(self, raw: bytes) -> tuple[bytes, list[Any]]:
        """A data-port request: (status, parts)."""
        try:
            key = raw.decode("ascii")
            self._check_key(key)
        except (UnicodeDecodeError, _Refused) as e:
            self.num_refused += 1
            why = "a key is ASCII" if isinstance(e, UnicodeDecodeError) else str(e)
            return DATA_ERR, [why.encode()]
        try:
            found = self.read(key)
        except Exception:  # the owner's callback failed: a miss, never a dead server
            logger.exception("peer: serving %r failed", key)
            return DATA_ERR, [b"the server failed to read it"]
        return (DATA_MISS, []) if found is None else (DATA_CHUNK, found)

    def close(self) -> None:
        """Stop serving (once; later calls do nothing)."""
        if self.data is not None:
            self.data.close()
        if not self._thread.is_alive():
            return
        with self._ctx.socket(zmq.PAIR) as wake:
            wake.setsockopt(zmq.LINGER, 0)
            wake.connect(self._wake_addr)
            with contextlib.suppress(zmq.Again):
                wake.send(b"", zmq.NOBLOCK)
            self._thread.join(5.0)


class _Refused(Exception):
    pass


class _DataServer:
    """The data port: a listener on `host` (an ephemeral port) and a thread per connection,
    each answering its requests in order with `serve(key bytes) -> (status, parts)`."""

    def __init__(self, host: str, serve: Callable[[bytes], tuple[bytes, list[Any]]]) -> None:
        self.serve = serve
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((host, 0))
            self._listener.listen(16)
        except OSError:
            self._listener.close()
            raise
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept, name="kv-peer-data", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed or len(self._conns) >= MAX_DATA_CONNECTIONS:
                    conn.close()
                    continue
                self._conns.add(conn)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(
                target=self._serve_conn, args=(conn,), name="kv-peer-data-conn", daemon=True
            ).start()

    def _serve_conn(self, conn: socket.socket) -> None:
        try:
            while True:
                head = _recv_exact(conn, 4)
                if head is None:
                    return  # the client closed
                n = int.from_bytes(head, "big")
                if not 0 < n <= MAX_KEY_BYTES:
                    _send_answer(conn, DATA_ERR, [f"a key is 1-{MAX_KEY_BYTES} bytes".encode()])
                    return
                raw = _recv_exact(conn, n)
                if raw is None:
                    return
                status, parts = self.serve(raw)
                _send_answer(conn, status, parts)
                if status == DATA_ERR:
                    return
        except OSError:
            return  # the client went away mid-answer, or close() shut us down
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """`n` bytes; None if the peer closed before the first."""
    buf = bytearray(n)
    return bytes(buf) if _recv_into(sock, memoryview(buf), eof_ok=True) else None


def _recv_into(sock: socket.socket, view: memoryview, eof_ok: bool = False) -> bool:
    """Fill `view`; False if the peer closed before its first byte and `eof_ok` (a clean
    end between messages), `ConnectionError` if it closed anywhere else."""
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0 and eof_ok:
                return False
            raise ConnectionError(f"closed after {got} of {len(view)} bytes")
        got += k
    return True


def _host(endpoint: str) -> str:
    """The host of a ZMQ tcp:// endpoint (an IPv6 one without its brackets)."""
    return endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")


def _send_answer(sock: socket.socket, status: bytes, parts: list[Any]) -> None:
    views = [memoryview(p).cast("B") for p in parts]
    head = status + bytes([len(views)]) + b"".join(struct.pack(">Q", len(v)) for v in views)
    sock.sendall(head)
    for v in views:  # the tier's own memory, sent without a copy
        sock.sendall(v)


class PayloadSink(Protocol):
    """Where a pull reads chunk payloads (`PeerClient.fetch_many`)."""

    def take(self, key: str, n: int) -> memoryview | None:
        """`n` writable bytes for chunk `key`'s payload; None: memory of its own."""
        ...


class RecvBuffers:
    """Two buffers of `size` bytes, their pages populated once, that pulls read chunk
    payloads into in turn: a chunk's data stays valid until the pull has read two more."""

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


class PeerClient:
    """Pulls from one rank of one peer. Not thread-safe: one user (the scheduler's lookup
    thread, or a worker's I/O thread)."""

    def __init__(
        self,
        endpoint: str,
        world_size: int,
        rank: int,
        namespace: str,
        mac_key: bytes | None = None,
        timeout_s: float = 5.0,
        max_reply_bytes: int = 1 << 30,
        curve: CurveClientKeys | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.curve = curve
        self.world_size, self.rank, self.namespace = world_size, rank, namespace
        self.mac_key = mac_key
        self.timeout_ms = max(1, int(timeout_s * 1000))
        self.max_reply_bytes = max_reply_bytes
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock: zmq.Socket[bytes] | None = None
        self._next = int.from_bytes(os.urandom(4), "big") << 32
        self._outstanding: set[bytes] = set()
        self._early: dict[bytes, list[zmq.Frame]] = {}
        self._data_port: int | None = None
        """The server's data port, once HELLO told it (0: it has none)."""
        self._data: socket.socket | None = None

    def _socket(self) -> zmq.Socket[bytes]:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_reply_bytes)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a peer not connected
            if self.curve is not None:
                self.curve.apply(sock)
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def _send(self, verb: bytes, arg: bytes) -> bytes:
        """Send a request; its id. `TierUnavailable` if it cannot leave in time."""
        self._next += 1
        rid = self._next.to_bytes(8, "big")
        sock = self._socket()
        try:
            if not sock.poll(self.timeout_ms, zmq.POLLOUT):
                raise TimeoutError
            sock.send_multipart([rid, verb, arg], zmq.NOBLOCK)
        except (TimeoutError, zmq.ZMQError) as e:
            raise self._unavailable(e, verb) from None
        self._outstanding.add(rid)
        return rid

    def _recv(self, rid: bytes, verb: bytes) -> tuple[bytes, list[zmq.Frame]]:
        """(status, payload frames) of the answer to request `rid`; `TierUnavailable` if it
        does not come in time (the socket is then replaced: a late answer is never read as
        another's). Answers to requests still outstanding are kept; others are dropped."""
        found = self._early.pop(rid, None)
        if found is not None:
            self._outstanding.discard(rid)
            return found[0].bytes, found[1:]
        sock = self._socket()
        try:
            while sock.poll(self.timeout_ms, zmq.POLLIN):
                frames = sock.recv_multipart(copy=False)
                if len(frames) < 2:
                    continue
                got = frames[0].bytes
                if got == rid:
                    self._outstanding.discard(rid)
                    return frames[1].bytes, frames[2:]
                if got in self._outstanding:
                    self._early[got] = frames[1:]
                # else: the late answer of a request given up on (ids never repeat)
            raise TimeoutError
        except (TimeoutError, zmq.ZMQError) as e:
            raise self._unavailable(e, verb) from None

    def _ask(self, verb: bytes, arg: bytes) -> tuple[bytes, list[zmq.Frame]]:
        return self._recv(self._send(verb, arg), verb)

    def _unavailable(self, e: Exception, verb: bytes) -> TierUnavailable:
        self.close()
        why = "did not answer" if isinstance(e, TimeoutError) else str(e)
        return TierUnavailable(
            f"peer {self.endpoint} {why} in {self.timeout_ms / 1000:g} s ({verb.decode()})"
        )

    def _ok(self, verb: bytes, arg: bytes) -> list[zmq.Frame]:
        status, payload = self._ask(verb, arg)
        if status == OK:
            return payload
        if status == ERR and payload:
            why = payload[0].bytes[:200].decode(errors="replace")
            raise TierError(f"peer {self.endpoint} refused {verb.decode()}: {why}")
        raise TierError(
            f"peer {self.endpoint}: unexpected answer {status[:16]!r} to {verb.decode()}"
        )

    def hello(self) -> None:
        """`ValueError` naming both if the peer runs another TP size, rank or model."""
        self._data_port = self._greet().data_port

    def _greet(self) -> _Hello:
        frames = self._ok(HELLO, b"")
        try:
            h = _hello.decode(frames[0].bytes)
        except (msgspec.DecodeError, IndexError) as e:
            raise TierError(f"peer {self.endpoint}: malformed HELLO answer ({e})") from None
        if h.world_size != self.world_size:
            raise ValueError(
                f"peer {self.endpoint} runs tensor-parallel size {h.world_size}, this instance "
                f"{self.world_size}: equal TP sizes only"
            )
        if h.rank != self.rank or h.namespace != self.namespace:
            raise ValueError(
                f"peer {self.endpoint} is rank {h.rank} of model {h.namespace!r}; asked for "
                f"rank {self.rank} of {self.namespace!r}"
            )
        if not 0 <= h.data_port <= 65535:
            raise TierError(f"peer {self.endpoint}: HELLO names data port {h.data_port}")
        return h

    def held_prefix(self, keys: Sequence[str]) -> int:
        """How many of `keys`, from the first, the peer holds."""
        total = 0
        for at in range(0, len(keys), MAX_KEYS):
            batch = list(keys[at : at + MAX_KEYS])
            frames = self._ok(HAS, _encode(batch))
            try:
                num = _int.decode(frames[0].bytes)
            except (msgspec.DecodeError, IndexError) as e:
                raise TierError(f"peer {self.endpoint}: malformed HAS answer ({e})") from None
            num = max(0, min(num, len(batch)))
            total += num
            if num < len(batch):
                break
        return total

    def release(self, lease_id: str) -> bool:
        """End lease `lease_id` at the peer; whether it held it."""
        frames = self._ok(RELEASE, lease_id.encode("ascii"))
        try:
            return _bool.decode(frames[0].bytes)
        except (msgspec.DecodeError, IndexError) as e:
            raise TierError(f"peer {self.endpoint}: malformed RELEASE answer ({e})") from None

    def fetch(self, key: str, asked: ChunkInfo, placement: TierPlacement) -> StoredChunk | None:
        """Chunk `key`, checked to be the one `asked` describes on this rank (`IntegrityError`
        naming why not); None if the peer does not hold it."""
        status, frames = self._ask(GET, key.encode("ascii"))
        return self._checked(key, asked, placement, status, [f.buffer for f in frames])

    def fetch_many(
        self,
        wanted: Sequence[tuple[str, ChunkInfo]],
        placement: TierPlacement,
        buffers: PayloadSink | None = None,
    ) -> Generator[StoredChunk | TierError | None]:
        """Each of `wanted` in order, as `fetch` returns it or the `TierError` it would raise,
        with up to WINDOW requests outstanding: the peer serialises the next chunks while
        this one travels and is checked. Once the peer stops answering, every chunk left is
        that `TierUnavailable`. Over the data port where the peer has one, with payloads
        read where `buffers` says (without it, each chunk gets memory of its own)."""
        if not wanted:
            return
        if self._data_port is None:
            try:
                self.hello()
            except (TierError, ValueError) as e:
                error = e if isinstance(e, TierError) else TierError(str(e))
                for _ in wanted:
                    yield error
                return
        if self._data_port:
            yield from self._fetch_data(wanted, placement, buffers)
            return
        sent: deque[bytes] = deque()
        ahead = 0
        try:
            for i, (key, asked) in enumerate(wanted):
                try:
                    while ahead < len(wanted) and len(sent) < WINDOW:
                        sent.append(self._send(GET, wanted[ahead][0].encode("ascii")))
                        ahead += 1
                    status, payload = self._recv(sent.popleft(), GET)
                except TierUnavailable as e:
                    sent.clear()
                    for _ in range(i, len(wanted)):
                        yield e
                    return
                try:
                    yield self._checked(key, asked, placement, status, [f.buffer for f in payload])
                except TierError as e:
                    yield e
        finally:
            if sent:  # abandoned with answers on their way: they go with the socket
                self.close()

    def _fetch_data(
        self,
        wanted: Sequence[tuple[str, ChunkInfo]],
        placement: TierPlacement,
        buffers: PayloadSink | None,
    ) -> Iterator[StoredChunk | TierError | None]:
        """`fetch_many` over the data port: requests WINDOW ahead on one connection, answers
        in order. A connection that fails, stalls past the timeout or frames an answer badly
        is closed, and every chunk left is that error."""
        sent = done = 0
        try:
            sock = self._data_socket()
            for key, asked in wanted:
                while sent < len(wanted) and sent - done < WINDOW:
                    raw = wanted[sent][0].encode("ascii")
                    sock.sendall(len(raw).to_bytes(4, "big") + raw)
                    sent += 1
                status, parts = self._read_answer(sock, buffers, key)
                if status == DATA_ERR:
                    why = bytes(parts[0][:200]).decode(errors="replace")
                    raise TierError(f"peer {self.endpoint} refused GET {key}: {why}")
                result: StoredChunk | TierError | None
                try:
                    result = self._checked(key, asked, placement, OK if parts else MISS, parts)
                except TierError as e:  # one bad chunk: the connection is still in step
                    result = e
                done += 1
                yield result
        except (OSError, TierError) as e:
            self._close_data()
            error: TierError
            if isinstance(e, TierError):
                error = e
            elif isinstance(e, TimeoutError):
                error = TierUnavailable(
                    f"peer {self.endpoint} did not answer in {self.timeout_ms / 1000:g} s (GET)"
                )
            else:
                error = TierUnavailable(f"peer {self.endpoint} data port: {e}")
            for _ in range(done, len(wanted)):
                yield error
        finally:
            if sent > done:  # abandoned with answers on their way: they go with the connection
                self._close_data()

    def _data_socket(self) -> socket.socket:
        if self._data is None:
            host = _host(self.endpoint)
            assert self._data_port
            timeout = self.timeout_ms / 1000
            sock = socket.create_connection((host, self._data_port), timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(timeout)
            self._data = sock
        return self._data

    def _read_answer(
        self, sock: socket.socket, buffers: PayloadSink | None, key: str
    ) -> tuple[bytes, list[memoryview]]:
        """One data-port answer to GET `key`: its status and parts (a chunk's payload read
        where `buffers` says). `TierError` if it is not framed as one."""
        head = _recv_exact(sock, 2)
        if head is None:
            raise ConnectionError("closed")
        status, count = head[:1], head[1]
        if status not in (DATA_CHUNK, DATA_MISS, DATA_ERR) or count > MAX_PARTS:
            raise TierError(f"peer {self.endpoint}: not a data-port answer")
        if (status == DATA_CHUNK) != (count in (4, 5)) or (status == DATA_ERR and count != 1):
            raise TierError(f"peer {self.endpoint}: an answer of {count} parts")
        lengths = struct.unpack(f">{count}Q", _recv_exact(sock, 8 * count) or b"")
        parts = []
        for index, n in enumerate(lengths):
            payload = status == DATA_CHUNK and index == 3
            if n > (self.max_reply_bytes if payload else REPLY_SLACK):
                raise TierError(f"peer {self.endpoint}: a part of {n} bytes")
            into = buffers.take(key, n) if payload and buffers is not None else None
            view = into if into is not None else memoryview(bytearray(n))
            _recv_into(sock, view)
            parts.append(view)
        return status, parts

    def _close_data(self) -> None:
        if self._data is not None:
            self._data.close()
            self._data = None

    def _checked(
        self,
        key: str,
        asked: ChunkInfo,
        placement: TierPlacement,
        status: bytes,
        payload: list[memoryview],
    ) -> StoredChunk | None:
        if status == MISS:
            return None
        if status != OK or not payload:
            raise TierError(f"peer {self.endpoint}: unexpected answer to GET {key}")
        try:
            if len(payload) == 1:  # one blob: one copy, which the tensor then uses in place
                info, data = unpack(bytearray(payload[0]), key, self.mac_key)
            else:  # pack's parts: the payload's memory becomes the tensor's
                info, data = unpack_parts(payload, key, self.mac_key)
        except IntegrityError:
            raise
        except TierError as e:
            raise IntegrityError(f"peer {self.endpoint}: {e}") from None
        found = StoredChunk(info, data)
        why = mismatch(asked, found, placement)
        if why is not None:
            raise IntegrityError(f"peer {self.endpoint}: chunk {key}: {why}")
        return found

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        self._outstanding.clear()
        self._early.clear()
        self._close_data()
