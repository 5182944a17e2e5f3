"""The peer transport over plain TCP (the default; CURVE's is curve.py): each serving rank
listens on the peer port + rank, a client keeps one connection, and requests are answered in
order on it. No ZMQ: whatever answers on a peer port is read by this module alone, within
bounds, so a listener that is not a kvconnect peer (an HTTP server, ZMTP, random bytes) is a
failed pull, never a crash (libzmq aborted the whole process on some of them: `fq.cpp:80`).

    connect   client: MAGIC, nonce (16 bytes)
              server: MAGIC, nonce (16), HELLO's length (2), HELLO, proof (32)
              client: proof (32)
    request   verb (1 byte: S HAS, G GET, R RELEASE), argument length (4), argument
    answer    status (1: K ok, M miss, E error), part count (1), 8-byte length per part,
              the parts (a chunk's: `pack`'s, its payload read straight into the caller's
              memory)

Proofs. With a deployment key (`hmac_key_file`), each side proves it holds it:
HMAC(key, side, both nonces[, HELLO]). A client that cannot is closed before it asks anything;
a server that cannot is not pulled from. Without a key the proofs are zeros.

Bounds, server side: at most `max_connections` per rank; past it a new connection closes the
longest idle one (one that has not proved the key first) or is closed itself. A connection
has `timeout_s` for its greeting and for each request once begun, IDLE_S between requests,
and `timeout_s` plus its bytes at `min_rate_mib_s` for each answer. One answer is in flight
per connection, so a client that never reads holds at most one chunk (for a cpu tier, a view
of the tier's own memory). Client side: one `Deadline` for each lookup or pull, whatever the
peer sends meanwhile; every part's length is bounded before a byte of it is read.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvconnect.connector.offload.common import ChunkInfo, rank_prefix
from kvconnect.connector.offload.peers.protocol import (
    ERR,
    GET,
    HAS,
    MAX_KEY_BYTES,
    MAX_LEASE_ID_BYTES,
    MAX_PARTS,
    MAX_REQUEST,
    MAX_SMALL,
    MISS,
    OK,
    RELEASE,
    REPLY_SLACK,
    SETTLE_POLL_S,
    WINDOW,
    Deadline,
    Fetched,
    Hello,
    PayloadSink,
    PeerClient,
    Refused,
    Served,
    Wanted,
    answer_has,
    ascii_arg,
    check_hello,
    check_key,
    checked_chunk,
    decode_hello,
    encode,
    has_keys,
)
from kvconnect.connector.offload.tiers.base import (
    IntegrityError,
    StoredChunk,
    TierError,
    TierPlacement,
    TierUnavailable,
)

logger = logging.getLogger(__name__)

MAGIC = b"KVCP\x01"
"""The protocol and its version, first on a connection from both sides."""
NONCE = 16
PROOF = 32
IDLE_S = 60.0
"""A server closes a connection that sends no request for this long."""
REUSE_S = 20.0
"""A client opens a new connection rather than use one idle this long (the server may be
about to close it)."""
MIN_IDLE_TO_EVICT_S = 0.5
"""A connection idle this long may be closed for a new one when the server is full."""
VERB_BYTE = {HAS: b"S", GET: b"G", RELEASE: b"R"}
VERB_OF = {v: k for k, v in VERB_BYTE.items()}
VERB_LIMIT = {HAS: MAX_REQUEST, GET: MAX_KEY_BYTES, RELEASE: MAX_LEASE_ID_BYTES}
STATUS_BYTE = {OK: b"K", MISS: b"M", ERR: b"E"}
STATUS_OF = {v: k for k, v in STATUS_BYTE.items()}


def _proof(key: bytes | None, side: bytes, *parts: bytes) -> bytes:
    if key is None:
        return bytes(PROOF)
    return hmac.new(key, b"kvconnect-peer/" + side + b"".join(parts), hashlib.sha256).digest()


class _Closed(ConnectionError):
    """The peer closed the connection before the first byte of an answer."""


def _stale(e: BaseException, reused: bool) -> bool:
    """Whether a failure is that of a reused connection the server has closed meanwhile (it
    closes idle ones): the request is then sent again on a new one, once. Every request is
    idempotent; a timeout never counts (the server took it and is slow)."""
    return reused and isinstance(e, OSError) and not isinstance(e, TimeoutError)


def _recv_into(sock: socket.socket, view: memoryview, deadline: Deadline) -> None:
    """Fill `view` by `deadline`; `_Closed` if the peer closed before its first byte,
    `ConnectionError` if anywhere after."""
    got = 0
    while got < len(view):
        sock.settimeout(deadline.left())
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                raise _Closed("closed")
            raise ConnectionError(f"closed after {got} of {len(view)} bytes")
        got += k


def _recv_exact(sock: socket.socket, n: int, deadline: Deadline) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf), deadline)
    return bytes(buf)


def _send(sock: socket.socket, data: bytes | memoryview, deadline: Deadline) -> None:
    sock.settimeout(deadline.left())  # sendall's timeout bounds the whole call
    sock.sendall(data)


class _Conn:
    """One client's connection on a server, as the accept thread sees it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.idle_since: float | None = time.monotonic()
        """When it began waiting for its client (None while a request is served)."""
        self.proven = False
        """It proved the deployment key (never, without one)."""


class TcpPeerServer:
    """One rank's server on host:port (port 0: one the kernel picks), on threads of its own: an
    accept thread and one per connection. `close()` stops it."""

    def __init__(
        self,
        host: str,
        port: int,
        hello: Hello,
        served: Served,
        mac_key: bytes | None,
        timeout_s: float,
        min_rate_mib_s: float,
        max_connections: int,
    ) -> None:
        self.served, self.mac_key = served, mac_key
        self.timeout_s, self.min_rate, self.max_connections = (
            timeout_s,
            min_rate_mib_s,
            max_connections,
        )
        self._hello = encode(hello)
        self._prefix = rank_prefix(hello.namespace, hello.world_size, hello.rank)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._listener = socket.create_server((host, port), family=family, backlog=128)
        except OSError as e:
            raise ValueError(f"peer: cannot serve on {host}:{port}: {e.strerror or e}") from None
        self.port: int = self._listener.getsockname()[1]
        self.endpoint = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, _Conn] = {}
        self._closed = False
        self.num_refused = 0
        """Requests refused (malformed, another rank's key); their connection closed."""
        self.num_bad_greetings = 0
        """Connections that did not greet as a peer (or prove the key) in time."""
        self.num_connections_refused = 0
        self.num_connections_evicted = 0
        self._thread = threading.Thread(target=self._accept, name="kv-peer-accept", daemon=True)
        self._thread.start()

    @property
    def num_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                if len(self._conns) >= self.max_connections and not self._evict():
                    self.num_connections_refused += 1
                    sock.close()
                    continue
                conn = self._conns[sock] = _Conn(sock)
            threading.Thread(
                target=self._serve, args=(conn,), name="kv-peer-conn", daemon=True
            ).start()

    def _evict(self) -> bool:
        """Close the longest idle connection (one that has not proved the key first); whether
        there was one. Under the lock."""
        now = time.monotonic()
        idle = [
            c
            for c in self._conns.values()
            if c.idle_since is not None and now - c.idle_since >= MIN_IDLE_TO_EVICT_S
        ]
        if not idle:
            return False
        victim = min(idle, key=lambda c: (c.proven, c.idle_since))
        del self._conns[victim.sock]
        with contextlib.suppress(OSError):
            victim.sock.shutdown(socket.SHUT_RDWR)  # its thread ends and closes it
        self.num_connections_evicted += 1
        return True

    def _serve(self, conn: _Conn) -> None:
        sock = conn.sock
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                greeted = self._greet(conn)
            except (OSError, TimeoutError):
                greeted = False
            if not greeted:
                with self._lock:
                    self.num_bad_greetings += 1
                return
            while True:
                conn.idle_since = time.monotonic()
                head = _recv_exact(sock, 5, Deadline(IDLE_S))
                conn.idle_since = None
                if not self._serve_one(sock, head):
                    return
        except (OSError, TimeoutError):
            return  # the client went away, stalled, or close() shut it down
        finally:
            with self._lock:
                self._conns.pop(sock, None)
            sock.close()

    def _greet(self, conn: _Conn) -> bool:
        """The handshake; whether the client is a peer (holding the key, if one is set)."""
        sock, deadline = conn.sock, Deadline(self.timeout_s)
        head = _recv_exact(sock, len(MAGIC) + NONCE, deadline)
        if head[: len(MAGIC)] != MAGIC:
            return False
        theirs, mine = head[len(MAGIC) :], os.urandom(NONCE)
        hello = self._hello
        proof = _proof(self.mac_key, b"server", theirs, mine, hello)
        _send(sock, MAGIC + mine + len(hello).to_bytes(2, "big") + hello + proof, deadline)
        proved = _recv_exact(sock, PROOF, deadline)
        if self.mac_key is None:
            return True
        conn.proven = hmac.compare_digest(proved, _proof(self.mac_key, b"client", mine, theirs))
        return conn.proven

    def _serve_one(self, sock: socket.socket, head: bytes) -> bool:
        """Read one request's argument, answer it; whether the connection stays open."""
        verb = VERB_OF.get(head[:1])
        n = int.from_bytes(head[1:5], "big")
        if verb is None or n > VERB_LIMIT[verb]:
            why = f"unknown verb {head[:1]!r}" if verb is None else f"{verb.decode()}: {n} bytes"
            self._refuse(sock, why)
            return False
        arg = _recv_exact(sock, n, Deadline(self.timeout_s))
        try:
            status, parts = self._answer(verb, arg)
        except Refused as e:
            self._refuse(sock, str(e))
            return False
        size = sum(memoryview(p).nbytes for p in parts)
        _send_answer(sock, status, parts, Deadline.for_bytes(self.timeout_s, size, self.min_rate))
        return True

    def _refuse(self, sock: socket.socket, why: str) -> None:
        with self._lock:
            self.num_refused += 1
        with contextlib.suppress(OSError, TimeoutError):
            _send_answer(sock, ERR, [why.encode()[:MAX_SMALL]], Deadline(self.timeout_s))

    def _answer(self, verb: bytes, arg: bytes) -> tuple[bytes, list[Any]]:
        served = self.served
        try:
            if verb == HAS:
                keys = has_keys(arg, self._prefix)
                settle = time.monotonic() + served.settle_s
                while time.monotonic() < settle and served.settling(keys):
                    time.sleep(SETTLE_POLL_S)  # this connection's thread only
                return OK, [answer_has(served, keys)]
            if verb == GET:
                key = ascii_arg(verb, arg, MAX_KEY_BYTES)
                check_key(self._prefix, key)
                found = served.read(key)
                return (MISS, []) if found is None else (OK, found)
            lease = ascii_arg(verb, arg, MAX_LEASE_ID_BYTES)
            return OK, [encode(bool(served.release(lease)))]
        except Refused:
            raise
        except Exception:  # the owner's callback failed: a miss, never a dead server
            logger.exception("peer: serving %s failed", verb.decode())
            return ERR, [b"the server failed to read it"]

    def close(self) -> None:
        """Stop serving and close every connection (once; later calls do nothing)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for sock in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(5.0)


def _send_answer(
    sock: socket.socket, status: bytes, parts: Sequence[Any], deadline: Deadline
) -> None:
    views = [memoryview(p).cast("B") for p in parts]
    head = STATUS_BYTE[status] + bytes([len(views)])
    _send(sock, head + b"".join(struct.pack(">Q", len(v)) for v in views), deadline)
    for v in views:  # the tier's own memory, sent without a copy
        _send(sock, v, deadline)


class TcpPeerClient(PeerClient):
    """Asks and pulls from one rank of one peer at host:port."""

    def __init__(
        self,
        host: str,
        port: int,
        world_size: int,
        rank: int,
        namespace: str,
        mac_key: bytes | None,
        max_payload: int = 1 << 30,
    ) -> None:
        self.host, self.port = host, port
        self.endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.world_size, self.rank, self.namespace = world_size, rank, namespace
        self.mac_key = mac_key
        self.max_payload = max_payload
        self._sock: socket.socket | None = None
        self._used = 0.0

    def _connect(self, deadline: Deadline) -> tuple[socket.socket, bool]:
        """The connection (a fresh one greeted, or one used lately) and whether it is reused;
        `TierError` naming why not."""
        if self._sock is not None and time.monotonic() - self._used < REUSE_S:
            return self._sock, True
        self.close()
        try:
            sock = socket.create_connection((self.host, self.port), timeout=deadline.left())
        except (OSError, TimeoutError) as e:
            raise self._unavailable(e, "connect") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._greet(sock, deadline)
        except (OSError, TimeoutError) as e:
            sock.close()
            raise self._unavailable(e, "greeting") from None
        except BaseException:
            sock.close()
            raise
        self._sock, self._used = sock, time.monotonic()
        return sock, False

    def _greet(self, sock: socket.socket, deadline: Deadline) -> None:
        mine = os.urandom(NONCE)
        _send(sock, MAGIC + mine, deadline)
        head = _recv_exact(sock, len(MAGIC) + NONCE + 2, deadline)
        if head[: len(MAGIC)] != MAGIC:
            raise TierError(f"peer {self.endpoint} is not a kvconnect peer (it sent {head[:8]!r})")
        theirs = head[len(MAGIC) : len(MAGIC) + NONCE]
        n = int.from_bytes(head[-2:], "big")
        if n > MAX_SMALL:
            raise TierError(f"peer {self.endpoint}: a HELLO of {n} bytes")
        raw = _recv_exact(sock, n, deadline)
        proof = _recv_exact(sock, PROOF, deadline)
        if self.mac_key is not None and not hmac.compare_digest(
            proof, _proof(self.mac_key, b"server", mine, theirs, raw)
        ):
            raise IntegrityError(
                f"peer {self.endpoint} does not prove the deployment's hmac key (another key, "
                "or none)"
            )
        try:
            hello = decode_hello(raw)
        except ValueError as e:  # msgspec's DecodeError and ValidationError
            raise TierError(f"peer {self.endpoint}: malformed HELLO ({e})") from None
        try:
            check_hello(self.endpoint, hello, self.world_size, self.rank, self.namespace)
        except ValueError as e:  # another TP size or model: never a source
            raise TierError(str(e)) from None
        _send(sock, _proof(self.mac_key, b"client", theirs, mine), deadline)

    def _unavailable(self, e: BaseException, what: str) -> TierUnavailable:
        self.close()
        why = (
            "did not answer in time" if isinstance(e, TimeoutError) else str(e) or type(e).__name__
        )
        return TierUnavailable(f"peer {self.endpoint} ({what}): {why}")

    def ask(self, verb: bytes, arg: bytes, deadline: Deadline) -> bytes:
        """As `PeerClient.ask`. A reused connection the server has closed meanwhile is
        opened again, once."""
        for attempt in range(2):
            sock, reused = self._connect(deadline)
            try:
                _send(sock, VERB_BYTE[verb] + len(arg).to_bytes(4, "big") + arg, deadline)
                status, parts = self._read_answer(sock, deadline, verb)
            except (OSError, TimeoutError) as e:
                if attempt == 0 and _stale(e, reused):
                    self.close()
                    continue
                raise self._unavailable(e, verb.decode()) from None
            except TierError:
                self.close()
                raise
            self._used = time.monotonic()
            if status == OK and len(parts) == 1:
                return bytes(parts[0])
            self.close()
            if status == ERR:
                why = bytes(parts[0][:200]).decode(errors="replace")
                raise TierError(f"peer {self.endpoint} refused {verb.decode()}: {why}")
            raise TierError(f"peer {self.endpoint}: unexpected answer to {verb.decode()}")
        raise AssertionError("unreachable")

    def _read_answer(
        self,
        sock: socket.socket,
        deadline: Deadline,
        verb: bytes,
        sink: PayloadSink | None = None,
        key: str = "",
    ) -> tuple[bytes, list[memoryview]]:
        """One answer: its status and parts, each bounded by what it may be before a byte of
        it is read (a chunk's payload lands where `sink` says); `TierError` if it is not
        framed as one."""
        head = _recv_exact(sock, 2, deadline)
        status, count = STATUS_OF.get(head[:1]), head[1]
        chunk = verb == GET and status == OK
        expected = {OK: (4, 5) if verb == GET else (1,), MISS: (0,), ERR: (1,)}
        if status is None or count not in expected[status]:
            raise TierError(f"peer {self.endpoint}: not an answer to {verb.decode()}")
        lengths = struct.unpack(f">{count}Q", _recv_exact(sock, 8 * count, deadline))
        parts = []
        for index, n in enumerate(lengths):
            payload = chunk and index == 3
            limit = self.max_payload if payload else REPLY_SLACK if chunk else MAX_SMALL
            if n > limit:
                raise TierError(f"peer {self.endpoint}: an answer part of {n} bytes")
            into = sink.take(key, n) if payload and sink is not None else None
            view = into if into is not None else memoryview(bytearray(n))
            _recv_into(sock, view, deadline)
            parts.append(view)
        assert len(parts) <= MAX_PARTS
        return status, parts

    def fetch_many(
        self,
        wanted: Wanted,
        placement: TierPlacement,
        deadline: Deadline,
        sink: PayloadSink | None = None,
    ) -> Fetched:
        """As `PeerClient.fetch_many`, with up to WINDOW requests outstanding on the one
        connection (the peer serialises the next chunks while one travels)."""
        if not wanted:
            return
        sent = done = 0
        sock: socket.socket | None = None
        try:
            for attempt in range(2):
                sock, reused = self._connect(deadline)
                sent = 0
                try:
                    sent = self._request_window(sock, wanted, sent, done, deadline)
                    first = self._read_answer(sock, deadline, GET, sink, wanted[0][0])
                    break
                except (OSError, TimeoutError) as e:
                    if attempt == 0 and _stale(e, reused):
                        self.close()
                        continue
                    raise
            assert sock is not None
            for i, (key, asked) in enumerate(wanted):
                if i:
                    sent = self._request_window(sock, wanted, sent, done, deadline)
                    first = self._read_answer(sock, deadline, GET, sink, key)
                status, parts = first
                if status == ERR:  # the server closes after an ERR: this chunk and the rest
                    why = bytes(parts[0][:200]).decode(errors="replace")
                    raise TierError(f"peer {self.endpoint} refused GET {key}: {why}")
                result: StoredChunk | TierError | None = None
                if status == OK:
                    try:  # one bad chunk: the connection is still in step
                        result = self._checked(key, asked, placement, parts)
                    except TierError as e:
                        result = e
                done += 1
                yield result
            self._used = time.monotonic()
        except (OSError, TimeoutError, TierError) as e:
            self.close()
            error = e if isinstance(e, TierError) else self._unavailable(e, "GET")
            for _ in range(done, len(wanted)):
                yield error
        finally:
            if sent > done:  # abandoned with answers on their way: they go with the connection
                self.close()

    def _request_window(
        self,
        sock: socket.socket,
        wanted: Wanted,
        sent: int,
        done: int,
        deadline: Deadline,
    ) -> int:
        while sent < len(wanted) and sent - done < WINDOW:
            raw = wanted[sent][0].encode("ascii")
            _send(sock, VERB_BYTE[GET] + len(raw).to_bytes(4, "big") + raw, deadline)
            sent += 1
        return sent

    def _checked(
        self, key: str, asked: ChunkInfo, placement: TierPlacement, parts: list[memoryview]
    ) -> StoredChunk:
        return checked_chunk(self.endpoint, key, asked, placement, parts, self.mac_key)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
