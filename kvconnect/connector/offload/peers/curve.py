"""The peer transport under CURVE (`curve_secret_key_file`): the verbs of protocol.py over ZMQ,
encrypted with CurveZMQ, a ROUTER per serving rank and a DEALER per (source, rank) pulling.

    request   [request id (8 bytes), verb, argument]
    answer    [request id, status, payload...]      (a chunk: `pack`'s parts as frames)

Every peer shares one certificate (`shared_curve`): a server is a CURVE server with its key
pair, a client connects with the server's public key and presents the same pair as its own.
A ZAP handler on the peers' own ZMQ context admits a client only if its public key is the
deployment's, and CurveZMQ's handshake proves the client holds the matching secret key: a
client that has only the public key completes no handshake. What that does not bound: libzmq
accepts every TCP connection (it has no cap); one that does not complete the handshake is
closed after `timeout_s` (HANDSHAKE_IVL).

libzmq aborted a process (`Assertion failed: !_more (src/fq.cpp:80)`) when a DEALER with
`IMMEDIATE` read a multipart message whose connection dropped between its parts: with that
option the session terminates the pipe on a disconnect, the fair queue keeps its "more parts
come" flag, and reading the next part from the new connection's empty pipe trips the assert.
An HTTP server's answer read as ZMTP/1.0 frames (libzmq takes any peer whose first byte is
not 0xFF for ZMTP/1.0) ends in exactly that. So here clients never set IMMEDIATE (a pipe
outlives its connections), and a ZAP domain makes libzmq refuse every pre-ZMTP-3 peer at the
handshake (a CURVE socket does too): no frame of a peer that is not a CURVE peer of this
deployment is ever decoded. The default transport (tcp.py) does not use ZMQ at all.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from typing import Any

import zmq
import zmq.auth.thread

from kvconnect.connector.offload.common import rank_prefix
from kvconnect.connector.offload.peers.protocol import (
    ERR,
    GET,
    HAS,
    MAX_KEY_BYTES,
    MAX_LEASE_ID_BYTES,
    MAX_PARTS,
    MAX_REQUEST,
    MISS,
    OK,
    RELEASE,
    REPLY_SLACK,
    SETTLE_POLL_S,
    WINDOW,
    Deadline,
    Fetched,
    Hello,
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
    TierError,
    TierPlacement,
    TierUnavailable,
)
from kvconnect.stream.curve import CurveClientKeys, CurveServerKeys

logger = logging.getLogger(__name__)

HELLO = b"HELLO"
ZAP_DOMAIN = "kvconnect-peer"
MAX_DEFERRED = 1024
"""HAS requests one server holds back at once (waiting for chunks still being stored); beyond
that one is answered at once with what is held."""
SEND_HWM = 8
"""Answers a server queues for one client that does not read: more are dropped (the client
then times out), so one connection holds at most this many chunks."""


def shared_curve(secret_key_file: str) -> tuple[CurveServerKeys, CurveClientKeys] | None:
    """The CURVE keys of a deployment's one peer certificate (a ZMQ certificate with its
    secret key, mode 0600; stream/curve.py makes one): every instance serves with it and
    pulls with it. None without a file; ValueError naming the file if it is unfit."""
    if not secret_key_file:
        return None
    server = CurveServerKeys.from_file(secret_key_file)
    return server, CurveClientKeys(server.public, server.public, server.secret)


class _Admitted:
    """The ZAP handler's rule: a client whose public key is a deployment's peer key."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        return domain == ZAP_DOMAIN and key in self.keys


class _Context:
    """The peers' ZMQ context in this process, with its ZAP handler."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.auth = zmq.auth.thread.ThreadAuthenticator(self.ctx, log=logger.getChild("zap"))
        self.auth.start()
        self.admitted = _Admitted()
        self.auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self.admitted)


_context_lock = threading.Lock()
_context: _Context | None = None


def _peer_context(admit: bytes | None = None) -> zmq.Context[zmq.Socket[bytes]]:
    """The peers' ZMQ context (one per process, apart from the event stream's, whose CURVE
    sockets keep their own rules), with its ZAP handler; `admit`: a public key to admit."""
    global _context
    with _context_lock:
        if _context is None or _context.pid != os.getpid():  # a forked child makes its own
            _context = _Context()
        if admit is not None:
            _context.admitted.keys.add(admit)
        return _context.ctx


class CurvePeerServer:
    """One rank's server, on its own thread, bound at tcp://host:port. `close()` stops it."""

    def __init__(
        self,
        host: str,
        port: int,
        hello: Hello,
        served: Served,
        keys: CurveServerKeys,
        timeout_s: float,
    ) -> None:
        self.served = served
        self._hello = encode(hello)
        self._prefix = rank_prefix(hello.namespace, hello.world_size, hello.rank)
        self._deferred: deque[tuple[float, bytes, bytes, list[str]]] = deque()
        ctx = self._ctx = _peer_context(admit=keys.public)
        self._sock = ctx.socket(zmq.ROUTER)
        for option, value in (
            (zmq.LINGER, 0),
            (zmq.RCVHWM, 64),
            (zmq.SNDHWM, SEND_HWM),
            (zmq.MAXMSGSIZE, MAX_REQUEST),  # requests: keys, never chunks
            (zmq.HANDSHAKE_IVL, max(1, int(timeout_s * 1000))),
        ):
            self._sock.setsockopt(option, value)
        self._sock.setsockopt_string(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        keys.apply(self._sock)
        where = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        try:
            self._sock.bind(where)
        except zmq.ZMQError as e:
            self._sock.close()
            raise ValueError(f"peer: cannot serve on {where}: {e}") from None
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.port = int(self.endpoint.rsplit(":", 1)[1])
        self._wake_addr = f"inproc://kvconnect-peer-{id(self)}-{os.getpid()}"
        self._wake = ctx.socket(zmq.PAIR)
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
                wait = int(SETTLE_POLL_S * 1000) if self._deferred else None
                ready = dict(poller.poll(wait))
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
        except Refused as e:
            self.num_refused += 1
            status, payload = ERR, [str(e).encode()]
        except Exception:  # the owner's callback failed: a miss, never a dead server
            logger.exception("peer: serving %r failed", verb[:16])
            status, payload = ERR, [b"the server failed to read it"]
        self._send(identity, rid, status, *payload)

    def _send(self, identity: bytes, rid: bytes, status: bytes, *payload: Any) -> None:
        with contextlib.suppress(zmq.ZMQError):  # the peer is gone or not reading
            self._sock.send_multipart([identity, rid, status, *payload], zmq.NOBLOCK, copy=False)

    def _handle(
        self, identity: bytes, rid: bytes, verb: bytes, arg: bytes
    ) -> tuple[bytes, list[Any]] | None:
        served = self.served
        if verb == HELLO:
            return OK, [self._hello]
        if verb == HAS:
            keys = has_keys(arg, self._prefix)
            if len(self._deferred) < MAX_DEFERRED and served.settle_s > 0 and served.settling(keys):
                self._deferred.append((time.monotonic() + served.settle_s, identity, rid, keys))
                return None
            return OK, [answer_has(served, keys)]
        if verb == GET:
            key = ascii_arg(verb, arg, MAX_KEY_BYTES)
            check_key(self._prefix, key)
            found = served.read(key)
            return (MISS, [b""]) if found is None else (OK, found)
        if verb == RELEASE:
            lease = ascii_arg(verb, arg, MAX_LEASE_ID_BYTES)
            return OK, [encode(bool(served.release(lease)))]
        raise Refused(f"unknown verb {verb[:16]!r} (HELLO, HAS, GET, RELEASE)")

    def _answer_settled(self) -> None:
        """Answer the held-back HAS requests whose keys are all stored, or whose time is up."""
        now, waiting = time.monotonic(), deque[tuple[float, bytes, bytes, list[str]]]()
        for deadline, identity, rid, keys in self._deferred:
            try:
                if now < deadline and self.served.settling(keys):
                    waiting.append((deadline, identity, rid, keys))
                    continue
                status, payload = OK, answer_has(self.served, keys)
            except Exception:  # the owner's callback failed: a miss, never a dead server
                logger.exception("peer: serving HAS failed")
                status, payload = ERR, b"the server failed to read it"
            self._send(identity, rid, status, payload)
        self._deferred = waiting

    def close(self) -> None:
        """Stop serving (once; later calls do nothing)."""
        if not self._thread.is_alive():
            return
        with self._ctx.socket(zmq.PAIR) as wake:
            wake.setsockopt(zmq.LINGER, 0)
            wake.connect(self._wake_addr)
            with contextlib.suppress(zmq.Again):
                wake.send(b"", zmq.NOBLOCK)
            self._thread.join(5.0)


class CurvePeerClient(PeerClient):
    """Asks and pulls from one rank of one peer over CurveZMQ."""

    def __init__(
        self,
        host: str,
        port: int,
        world_size: int,
        rank: int,
        namespace: str,
        mac_key: bytes | None,
        keys: CurveClientKeys,
        max_payload: int = 1 << 30,
    ) -> None:
        self.endpoint = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        self.keys = keys
        self.world_size, self.rank, self.namespace = world_size, rank, namespace
        self.mac_key = mac_key
        self.max_reply = max_payload + REPLY_SLACK
        self._ctx = _peer_context()
        self._sock: zmq.Socket[bytes] | None = None
        self._greeted = False
        self._next = int.from_bytes(os.urandom(4), "big") << 32
        self._outstanding: set[bytes] = set()
        self._early: dict[bytes, list[zmq.Frame]] = {}

    def _socket(self) -> zmq.Socket[bytes]:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_reply)
            sock.setsockopt(zmq.RCVHWM, WINDOW + 2)  # what may wait unread: the window's answers
            # No IMMEDIATE: with it a disconnect ends the pipe between a message's parts
            # (the module's docstring: libzmq's fq.cpp:80 abort).
            self.keys.apply(sock)
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def _send(self, verb: bytes, arg: bytes, deadline: Deadline) -> bytes:
        self._next += 1
        rid = self._next.to_bytes(8, "big")
        sock = self._socket()
        try:
            if not sock.poll(max(1, int(deadline.left() * 1000)), zmq.POLLOUT):
                raise TimeoutError
            sock.send_multipart([rid, verb, arg], zmq.NOBLOCK)
        except (TimeoutError, zmq.ZMQError) as e:
            raise self._unavailable(e, verb) from None
        self._outstanding.add(rid)
        return rid

    def _recv(self, rid: bytes, verb: bytes, deadline: Deadline) -> tuple[bytes, list[zmq.Frame]]:
        """(status, payload frames) of the answer to `rid` by `deadline` (answers of other
        requests still outstanding are kept, any other frame dropped at once: what a peer
        sends meanwhile never extends the wait). `TierUnavailable` if it does not come."""
        found = self._early.pop(rid, None)
        if found is not None:
            self._outstanding.discard(rid)
            return found[0].bytes, found[1:]
        sock = self._socket()
        try:
            while sock.poll(max(1, int(deadline.left() * 1000)), zmq.POLLIN):
                frames = sock.recv_multipart(copy=False)
                if not 2 <= len(frames) <= MAX_PARTS + 2:
                    continue
                got = frames[0].bytes
                if got == rid:
                    self._outstanding.discard(rid)
                    return frames[1].bytes, frames[2:]
                if got in self._outstanding:
                    self._early[got] = frames[1:]
                # else: a late answer to a request given up on (ids never repeat), or junk
            raise TimeoutError
        except (TimeoutError, zmq.ZMQError) as e:
            raise self._unavailable(e, verb) from None

    def _unavailable(self, e: Exception, verb: bytes) -> TierUnavailable:
        self.close()
        # EAGAIN on a send that poll() allowed: the pipe went (a handshake refused) meanwhile
        late = isinstance(e, (TimeoutError, zmq.Again))
        why = "did not answer in time" if late else str(e)
        return TierUnavailable(f"peer {self.endpoint} ({verb.decode()}): {why}")

    def ask(self, verb: bytes, arg: bytes, deadline: Deadline) -> bytes:
        if not self._greeted:
            self._greet(deadline)
        status, payload = self._recv(self._send(verb, arg, deadline), verb, deadline)
        if status == OK and payload:
            return payload[0].bytes
        if status == ERR and payload:
            why = payload[0].bytes[:200].decode(errors="replace")
            raise TierError(f"peer {self.endpoint} refused {verb.decode()}: {why}")
        raise TierError(
            f"peer {self.endpoint}: unexpected answer {status[:16]!r} to {verb.decode()}"
        )

    def _greet(self, deadline: Deadline) -> None:
        status, frames = self._recv(self._send(HELLO, b"", deadline), HELLO, deadline)
        if status != OK or not frames:
            raise TierError(f"peer {self.endpoint}: no HELLO")
        try:
            hello = decode_hello(frames[0].bytes)
        except ValueError as e:
            raise TierError(f"peer {self.endpoint}: malformed HELLO ({e})") from None
        try:
            check_hello(self.endpoint, hello, self.world_size, self.rank, self.namespace)
        except ValueError as e:  # another TP size or model: never a source
            raise TierError(str(e)) from None
        self._greeted = True

    def fetch_many(
        self,
        wanted: Wanted,
        placement: TierPlacement,
        deadline: Deadline,
        sink: Any = None,
    ) -> Fetched:
        """As `PeerClient.fetch_many` (each chunk lands in memory of its own: `sink` is not
        used over ZMQ)."""
        if not wanted:
            return
        try:
            if not self._greeted:
                self._greet(deadline)
        except TierError as e:
            for _ in wanted:
                yield e
            return
        sent: deque[bytes] = deque()
        ahead = 0
        try:
            for i, (key, asked) in enumerate(wanted):
                try:
                    while ahead < len(wanted) and len(sent) < WINDOW:
                        sent.append(self._send(GET, wanted[ahead][0].encode("ascii"), deadline))
                        ahead += 1
                    status, payload = self._recv(sent.popleft(), GET, deadline)
                except TierUnavailable as e:
                    sent.clear()
                    for _ in range(i, len(wanted)):
                        yield e
                    return
                if status == MISS:
                    yield None
                    continue
                if status != OK or len(payload) not in (4, 5):
                    yield TierError(f"peer {self.endpoint}: unexpected answer to GET {key}")
                    continue
                try:
                    parts = [f.buffer for f in payload]
                    yield checked_chunk(self.endpoint, key, asked, placement, parts, self.mac_key)
                except TierError as e:
                    yield e
        finally:
            if sent:  # abandoned with answers on their way: they go with the socket
                self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        self._greeted = False
        self._outstanding.clear()
        self._early.clear()
