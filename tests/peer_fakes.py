"""Peers of the tests that speak kvconnect's peer wire (peers/tcp.py) from the other side: a
raw client past the handshake, and a fake server whose answers a test writes byte by byte
(forged chunks, bad framing, stalls); and what the tests of serve's peer pulls share (an
instance's peer config, a prompt of whole chunks)."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import random
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec

from kvconnect.connector.offload.peers.protocol import Hello
from kvconnect.connector.offload.peers.tcp import MAGIC

CHUNK = 32


def peer_config(peer_port: int, sources: tuple[int, ...] | list[int] = (), **peer: Any) -> str:
    """`--kv-transfer-config` of an instance with a cpu tier (chunks of CHUNK tokens) serving
    its peer tier on `peer_port` and pulling from the peers on `sources` (loopback ports)."""
    return json.dumps(
        {
            "kv_connector": "OffloadConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "chunk_size": CHUNK,
                "tiers": [{"kind": "cpu", "max_bytes": 1 << 26}],
                "peer": {
                    "port": peer_port,
                    "timeout_s": 1.0,
                    "sources": [f"127.0.0.1:{p}" for p in sources],
                    **peer,
                },
            },
        }
    )


def prompt(seed: int, n: int = 150) -> list[int]:
    """`n` random byte tokens (150: 4 whole chunks of 32 and a tail)."""
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def greeted(port: int, mac: bytes | None = None) -> socket.socket:
    """A raw connection to a server, past its handshake."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    mine = os.urandom(16)
    s.sendall(MAGIC + mine)
    head = recv_exact(s, len(MAGIC) + 16 + 2)
    theirs = head[len(MAGIC) : len(MAGIC) + 16]
    recv_exact(s, int.from_bytes(head[-2:], "big") + 32)
    proof = bytes(32)
    if mac is not None:
        proof = hmac.new(mac, b"kvconnect-peer/client" + theirs + mine, hashlib.sha256).digest()
    s.sendall(proof)
    return s


def hello_of(port: int) -> Hello:
    """What the server on `port` says of itself (its TP size, rank and model namespace)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(MAGIC + os.urandom(16))
        head = recv_exact(s, len(MAGIC) + 16 + 2)
        return msgspec.msgpack.decode(recv_exact(s, int.from_bytes(head[-2:], "big")), type=Hello)


def recv_exact(s: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        more = s.recv(n - len(got))
        if not more:
            raise ConnectionError(f"closed after {len(got)} of {n}")
        got += more
    return got


def until_closed(s: socket.socket) -> bytes:
    got = b""
    while chunk := s.recv(1 << 16):
        got += chunk
    return got


Reply = bytes | Callable[[socket.socket], None] | None


class FakePeer:
    """A peer of the test on a TCP port: it greets as a kvconnect server (as `hello`, proving
    `mac`) unless `greeting` replaces the whole exchange (then it closes, or with `hold` keeps
    the connection open), then answers each request with `answer(verb, argument)`: raw bytes
    sent as they are, a function that sends on the connection itself, or None (nothing)."""

    def __init__(
        self,
        answer: Callable[[bytes, bytes], Reply] | None = None,
        greeting: bytes | None = None,
        mac: bytes | None = None,
        hello: Hello | None = None,
        hold: bool = True,
        port: int = 0,
    ) -> None:
        self.answer, self.greeting, self.mac, self.hold = answer, greeting, mac, hold
        self.hello = msgspec.msgpack.encode(hello or Hello(1, 0, "tiny@0123456789abcdef"))
        self.listener = socket.create_server(("127.0.0.1", port))
        self.port = self.listener.getsockname()[1]
        self.stop = threading.Event()
        self.requests: list[tuple[bytes, bytes]] = []
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while not self.stop.is_set():
                conn, _ = self.listener.accept()
                self.conns.append(conn)
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn:
            if self.greeting is not None:
                conn.sendall(self.greeting)
                if self.hold:
                    self.stop.wait(30)
                return
            head = recv_exact(conn, len(MAGIC) + 16)
            theirs, mine = head[len(MAGIC) :], os.urandom(16)
            proof = bytes(32)
            if self.mac is not None:
                proof = hmac.new(
                    self.mac, b"kvconnect-peer/server" + theirs + mine + self.hello, hashlib.sha256
                ).digest()
            conn.sendall(MAGIC + mine + len(self.hello).to_bytes(2, "big") + self.hello + proof)
            recv_exact(conn, 32)
            while not self.stop.is_set():
                head = recv_exact(conn, 5)
                arg = recv_exact(conn, int.from_bytes(head[1:], "big"))
                self.requests.append((head[:1], arg))
                reply = self.answer(head[:1], arg) if self.answer else None
                if callable(reply):
                    reply(conn)
                elif reply:
                    conn.sendall(reply)

    def close(self) -> None:
        """Stop, and close every connection (a source that goes away)."""
        self.stop.set()
        self.listener.close()
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


@contextmanager
def fake_peer(*args: Any, **kw: Any) -> Iterator[FakePeer]:
    peer = FakePeer(*args, **kw)
    try:
        yield peer
    finally:
        peer.close()


def answer_of(*parts: bytes | memoryview, status: bytes = b"K") -> bytes:
    return (
        status
        + bytes([len(parts)])
        + b"".join(len(p).to_bytes(8, "big") for p in parts)
        + b"".join(bytes(p) for p in parts)
    )
