"""The peer transports (`peers/tcp.py`, `peers/curve.py`) over real sockets on loopback: a
chunk pulled bit-exact, refusals on both sides, every forged or badly framed answer refused
before use, and the bounds that keep a hostile peer or client from holding a rank: deadlines,
connection caps, idle and write timeouts, the key proof (issue 46)."""

from __future__ import annotations

import contextlib
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import zmq
import zmq.auth

from kvconnect.connector.offload.common import ChunkInfo, OffloadConfig, chunk_key
from kvconnect.connector.offload.peers.curve import CurvePeerClient, CurvePeerServer, shared_curve
from kvconnect.connector.offload.peers.protocol import (
    MAX_KEYS,
    Deadline,
    Hello,
    RecvBuffers,
    Served,
)
from kvconnect.connector.offload.peers.tcp import TcpPeerClient, TcpPeerServer
from kvconnect.connector.offload.peers.transport import PeerKeys
from kvconnect.connector.offload.tiers.base import (
    IntegrityError,
    StoredChunk,
    TierError,
    TierPlacement,
    TierUnavailable,
    pack,
)
from kvconnect.stream.curve import CurveClientKeys
from tests.helpers import wait_for
from tests.peer_fakes import Reply, answer_of, fake_peer, greeted, until_closed

NS = "tiny@0123456789abcdef"
SHAPE = (2, 2, 32, 1, 4)
PAYLOAD = math.prod(SHAPE) * 4
PLACEMENT = TierPlacement(1, 0, SHAPE, torch.float32, NS)
MAC = b"k" * 32
HELLO = Hello(1, 0, NS)


def info(i: int) -> ChunkInfo:
    return ChunkInfo(
        bytes([i]) * 32, (i * 10, i * 10 + 1), None if i == 0 else i * 10 - 9, tuple(range(32)), 16
    )


def key(i: int, rank: int = 0, world: int = 1) -> str:
    return chunk_key(NS, world, rank, info(i).last_block_hash)


CHUNKS = {key(i): (info(i), torch.randn(SHAPE)) for i in range(3)}


def served(
    chunks: dict[str, tuple[ChunkInfo, torch.Tensor]] = CHUNKS,
    mac: bytes | None = None,
    **settle: Any,
) -> Served:
    def held(keys: list[str]) -> int:
        n = 0
        while n < len(keys) and keys[n] in chunks:
            n += 1
        return n

    def read(k: str) -> list[object] | None:
        found = chunks.get(k)
        return None if found is None else list(pack(k, *found, mac))  # as a worker sends it

    return Served(held, read, lambda lease: lease == "mine", **settle)


@contextmanager
def serving(
    mac: bytes | None = None,
    hello: Hello = HELLO,
    timeout_s: float = 5.0,
    max_connections: int = 8,
    **kw: Any,
) -> Iterator[tuple[TcpPeerServer, Callable[..., TcpPeerClient]]]:
    server = TcpPeerServer(
        "127.0.0.1", 0, hello, served(mac=mac, **kw), mac, timeout_s, 64.0, max_connections
    )
    clients: list[TcpPeerClient] = []

    def client(mac_key: bytes | None = mac, **kwargs: Any) -> TcpPeerClient:
        c = TcpPeerClient("127.0.0.1", server.port, 1, 0, NS, mac_key, PAYLOAD, **kwargs)
        clients.append(c)
        return c

    try:
        yield server, client
    finally:
        for c in clients:
            c.close()
        server.close()


def soon() -> Deadline:
    return Deadline(5.0)


def pull(c: Any, *indices: int, sink: Any = None, deadline: Deadline | None = None) -> list[Any]:
    wanted = [(key(i), info(i)) for i in indices]
    return list(c.fetch_many(wanted, PLACEMENT, deadline or soon(), sink))


def test_a_chunk_is_pulled_bit_exact_a_miss_is_none_and_a_lease_released() -> None:
    with serving(MAC) as (_, client):
        c = client()
        assert c.held_prefix([key(0), key(1), key(7), key(2)], soon()) == 2
        found, missing = pull(c, 1, 7)
        assert isinstance(found, StoredChunk) and found.info == info(1)
        assert torch.equal(found.data, CHUNKS[key(1)][1])
        assert missing is None
        assert c.release("mine", soon()) is True and c.release("other", soon()) is False


def test_a_pull_reads_its_chunks_into_the_buffers_it_is_given() -> None:
    """Three chunks and a miss, bit-exact, each chunk's data in the buffers given (in turn):
    a chunk stays intact until two more have been read."""
    with serving(MAC) as (_, client):
        c = client()
        buffers = RecvBuffers(PAYLOAD)
        wanted = [(key(i), info(i)) for i in (0, 1, 2, 7)]
        pulls = c.fetch_many(wanted, PLACEMENT, soon(), buffers)
        first = next(pulls)
        assert isinstance(first, StoredChunk) and torch.equal(first.data, CHUNKS[key(0)][1])
        second = next(pulls)
        assert isinstance(second, StoredChunk)
        assert torch.equal(first.data, CHUNKS[key(0)][1])  # one more read: still intact
        third = next(pulls)
        assert isinstance(third, StoredChunk) and torch.equal(third.data, CHUNKS[key(2)][1])
        assert first.data.data_ptr() == third.data.data_ptr()  # in turn: the same memory
        assert torch.equal(second.data, CHUNKS[key(1)][1])
        assert next(pulls) is None  # key 7: a miss
        again = pull(c, 0)  # no buffers: memory of its own, on the same connection
        assert isinstance(again[0], StoredChunk)


def test_a_has_naming_a_chunk_being_stored_is_answered_once_stored_holding_up_nobody() -> None:
    """A P/D prefill answers before its chunks are stored: a HAS naming one still on its way
    waits for it (up to `settle_s`) on its own connection, while others are answered."""
    chunks = dict(CHUNKS)
    asked = threading.Event()

    def settling(keys: list[str]) -> bool:
        if key(3) not in keys:
            return False
        asked.set()
        return key(3) not in chunks

    with serving(chunks=chunks, settling=settling, settle_s=30) as (_, client):
        waiting, other = client(), client()
        got: list[int] = []
        wanted = [key(0), key(1), key(2), key(3)]
        thread = threading.Thread(target=lambda: got.append(waiting.held_prefix(wanted, soon())))
        thread.start()
        assert asked.wait(5)  # held back now
        assert other.held_prefix([key(0), key(1)], soon()) == 2
        assert isinstance(pull(other, 1)[0], StoredChunk)
        assert thread.is_alive() and got == []
        chunks[key(3)] = (info(3), torch.randn(SHAPE))  # its store is done
        thread.join(10)
        assert got == [4]


def test_a_has_held_back_past_settle_s_is_answered_with_what_is_held() -> None:
    with serving(settling=lambda keys: True, settle_s=0.2) as (_, client):
        assert client().held_prefix([key(0), key(1), key(2), key(3)], soon()) == 3


def test_another_tp_size_is_refused_naming_both() -> None:
    refused = pytest.raises(TierError, match="tensor-parallel size 2, this instance 1")
    with serving(hello=Hello(2, 0, NS)) as (_, client), refused:
        client().held_prefix([key(0)], soon())


@pytest.mark.parametrize(
    ("request_", "says"),
    [
        (b"X" + (0).to_bytes(4, "big"), b"unknown verb"),
        (b"S" + (3).to_bytes(4, "big") + b"\xc1\xc1\xc1", b"not a msgpack list"),
        (
            b"S"
            + (n := len(a := msgspec.msgpack.encode([key(0)] * (MAX_KEYS + 1)))).to_bytes(4, "big")
            + a,
            b"at most",
        ),
        (b"G" + len(k := key(0, 1, 2).encode()).to_bytes(4, "big") + k, b"not one of this rank's"),
        (b"G" + (1).to_bytes(4, "big") + b"\xff", b"ASCII"),
        (b"G" + (1 << 20).to_bytes(4, "big"), b"GET: 1048576 bytes"),
        (b"R" + (0).to_bytes(4, "big"), b"RELEASE: its argument is 1-256"),
    ],
)
def test_a_bad_request_is_refused_naming_why_its_connection_closed_and_the_server_serves_on(
    request_: bytes, says: bytes
) -> None:
    with serving() as (server, client):
        with greeted(server.port) as s:
            s.sendall(request_)
            answer = until_closed(s)
        assert answer[:2] == b"E\x01" and says in answer[10:], answer
        assert server.num_refused == 1
        assert client().held_prefix([key(0)], soon()) == 1


def chunk_parts(k: str, i: int, mac: bytes | None = None, **changes: object) -> list[bytes]:
    meta, data = CHUNKS[key(i)]
    fields = {**meta.__dict__, **changes}
    return [bytes(p) for p in pack(k, ChunkInfo(**fields), data, mac)]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("parts", "mac", "says"),
    [
        (lambda: chunk_parts(key(2), 2), None, "entry holds"),  # chunk 2 sent as chunk 1
        (lambda: chunk_parts(key(1), 1, token_ids=tuple(range(1, 33))), None, "token ids"),
        (lambda: chunk_parts(key(1), 1, parent_block_hash=5), None, "parent hash"),
        (lambda: [*chunk_parts(key(1), 1)[:3], b"\0" * PAYLOAD], None, "checksum"),
        (lambda: chunk_parts(key(1), 1), MAC, "unsigned"),
        (lambda: chunk_parts(key(1), 1, b"x" * 32), MAC, "wrong signature"),
        (lambda: [b"not", b"a", b"chunk", b"!"], None, "bad magic"),
    ],
)
def test_a_forged_chunk_is_refused_before_use(
    parts: Callable[[], list[bytes]], mac: bytes | None, says: str
) -> None:
    with fake_peer(lambda verb, arg: answer_of(*parts()), mac=mac) as peer:
        c = TcpPeerClient("127.0.0.1", peer.port, 1, 0, NS, mac, PAYLOAD)
        try:
            [got] = pull(c, 1)
            assert isinstance(got, IntegrityError) and re.search(says, str(got)), got
        finally:
            c.close()


@pytest.mark.parametrize(
    ("answer", "error", "says"),
    [
        (b"Z\x00", TierError, "not an answer to GET"),
        (b"K\x09", TierError, "not an answer to GET"),
        (answer_of(b"a", b"b"), TierError, "not an answer to GET"),
        (answer_of(b"h", b"h", b"h", b"x" * (PAYLOAD + 1)), TierError, f"part of {PAYLOAD + 1}"),
        (
            b"K\x04" + b"".join(n.to_bytes(8, "big") for n in (1, 1, 1, 1 << 40)) + b"hhh",
            TierError,
            "part of 1099511627776 bytes",
        ),
        (b"K\x04" + (1).to_bytes(8, "big"), TierUnavailable, "closed after"),  # F14
        (answer_of(b"h", b"h", b"h", b"x" * 64)[:-10], TierUnavailable, "closed after"),
        (answer_of(b"nope", status=b"E"), TierError, "refused GET .*: nope"),
    ],
)
def test_an_answer_framed_badly_is_never_taken(
    answer: bytes, error: type[TierError], says: str
) -> None:
    """Each bad answer fails the chunk it came for and the rest of the pull (the connection is
    closed: nothing after it can be trusted to be in step); a length is checked before a
    byte of its part is read, and an answer cut anywhere is a peer error, not a traceback."""

    def once(verb: bytes, arg: bytes) -> Reply:
        if arg != key(1).encode():
            return None
        return lambda conn: (conn.sendall(answer), conn.shutdown(socket.SHUT_WR), None)[2]

    with fake_peer(once) as peer:
        c = TcpPeerClient("127.0.0.1", peer.port, 1, 0, NS, None, PAYLOAD)
        try:
            got = pull(c, 1, 2, deadline=Deadline(2.0))
            assert all(isinstance(g, error) for g in got), got
            assert re.search(says, str(got[0])), got
            assert c._sock is None
        finally:
            c.close()


@pytest.mark.parametrize(
    "greeting",
    [
        b"HTTP/1.1 400 Bad Request\r\nContent-Length: 11\r\nConnection: close\r\n\r\nBad Request",
        b"\x01\x00" * 16,  # ZMTP/1.0: a length byte and flags
        b"\xff" + b"\0" * 8 + b"\x7f\x03\x00NULL" + b"\0" * 48,  # a ZMTP/3 greeting
        bytes(range(256)) * 4,
    ],
    ids=["http", "zmtp1", "zmtp3", "random"],
)
def test_a_listener_that_is_not_a_peer_is_a_refused_pull_never_a_crash(greeting: bytes) -> None:
    """What answers on a peer port is read by the transport alone: an HTTP server, ZMTP at
    any version or random bytes fail the lookup or the pull at once, naming the endpoint."""
    with fake_peer(greeting=greeting) as peer:
        c = TcpPeerClient("127.0.0.1", peer.port, 1, 0, NS, None, PAYLOAD)
        try:
            with pytest.raises(TierError, match=f"127.0.0.1:{peer.port}"):
                c.held_prefix([key(0)], Deadline(2.0))
            assert all(isinstance(g, TierError) for g in pull(c, 0, 1, deadline=Deadline(2.0)))
        finally:
            c.close()


def test_a_source_that_trickles_bytes_is_cut_off_at_the_pulls_deadline() -> None:
    """F2: the chunk's head, then a byte every 50 ms. The pull ends at its deadline (timeout
    plus its bytes at the minimum rate), failing the rest, however often bytes come."""
    head = answer_of(b"h", b"h", b"h", b"x" * PAYLOAD)[: 2 + 4 * 8 + 3]
    stop = threading.Event()

    def trickle(verb: bytes, arg: bytes) -> Reply:
        if arg != key(0).encode():
            return None

        def send(conn: socket.socket) -> None:
            conn.sendall(head)
            while not stop.wait(0.05):
                conn.sendall(b"x")

        return send

    with fake_peer(trickle) as peer:
        c = TcpPeerClient("127.0.0.1", peer.port, 1, 0, NS, None, PAYLOAD)
        try:
            start = time.monotonic()
            got = pull(c, 0, 1, deadline=Deadline.for_bytes(0.5, 2 * PAYLOAD, 1.0))
            took = time.monotonic() - start
            assert all(isinstance(g, TierUnavailable) for g in got), got
            assert "did not answer in time" in str(got[0])
            assert 0.5 <= took < 3.0  # 0.5 s + 2 chunks of 2 KiB at 1 MiB/s; never the trickle's
        finally:
            stop.set()
            c.close()


def test_a_source_that_dies_mid_pull_fails_the_rest_of_it_in_its_deadline() -> None:
    hang = threading.Event()
    chunks = dict(CHUNKS)

    class Hanging(dict[str, Any]):
        def get(self, k: str, default: Any = None) -> Any:
            if k != key(0):
                hang.wait(30)  # stuck until the test ends
            return chunks.get(k, default)

    with serving(chunks=Hanging()) as (_, client):
        try:
            got = pull(client(), 0, 1, 2, deadline=Deadline(0.5))
            assert isinstance(got[0], StoredChunk) and torch.equal(got[0].data, CHUNKS[key(0)][1])
            assert all(isinstance(g, TierUnavailable) for g in got[1:]), got
        finally:
            hang.set()


def test_a_client_that_never_reads_is_closed_at_its_answers_deadline() -> None:
    """F7: GETs sent, answers never read: the server's thread for that connection gives up
    once the answer's deadline (timeout plus its bytes at the minimum rate) has passed, and
    holds one answer at a time meanwhile; others are served."""
    big = (1, 2, 8 << 20)  # 64 MiB a chunk: more than the socket buffers hold
    chunks = {key(0): (info(0), torch.zeros(big))}
    with serving(chunks=chunks, timeout_s=0.5) as (server, client):
        s = greeted(server.port)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        for _ in range(4):
            raw = key(0).encode()
            s.sendall(b"G" + len(raw).to_bytes(4, "big") + raw)
        wait_for(lambda: server.num_connections == 0, timeout=10, what="the reader cut off")
        assert client().held_prefix([key(0)], soon()) == 1
        s.close()


def test_a_connection_that_does_not_greet_is_closed_in_timeout_s() -> None:
    with serving(timeout_s=0.3) as (server, client):
        silent = socket.create_connection(("127.0.0.1", server.port))
        silent.settimeout(5)
        assert silent.recv(1) == b""  # closed by the server
        assert server.num_bad_greetings == 1
        assert client().held_prefix([key(0)], soon()) == 1
        silent.close()


def test_connections_are_bounded_and_an_idle_one_makes_room() -> None:
    """F8/F9: past `max_connections` a new connection closes the longest idle one that never
    proved the key (then the longest idle one); with none idle it is closed itself."""
    with serving(MAC, max_connections=4) as (server, client):
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
        proven = client()
        assert proven.held_prefix([key(0)], soon()) == 1  # idle now, having proved the key
        time.sleep(0.6)  # MIN_IDLE_TO_EVICT_S
        another = client()
        assert another.held_prefix([key(0)], soon()) == 1  # an unproven idle one made room
        assert server.num_connections_evicted == 1
        assert proven.held_prefix([key(1)], soon()) == 1  # still connected
        many = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(50)]

        def handled() -> int:
            return server.num_connections_refused + server.num_connections_evicted

        wait_for(lambda: handled() == 51, what="each new connection refused or making room")
        assert server.num_connections <= 4
        for s in idle + many:
            s.close()


def test_a_peer_without_the_key_is_refused_both_ways() -> None:
    """A client that cannot prove the deployment key is closed before it asks anything; a
    server that cannot is never pulled from."""
    with serving(MAC) as (server, client):
        with pytest.raises(TierUnavailable):
            client(mac_key=None).held_prefix([key(0)], soon())
        assert server.num_bad_greetings == 1
    refused = pytest.raises(IntegrityError, match="does not prove the deployment's hmac key")
    with serving(None) as (_, client), refused:
        client(mac_key=MAC).held_prefix([key(0)], soon())


def test_a_server_closes_once_and_a_second_close_does_nothing() -> None:
    with serving() as (server, client):
        assert client().held_prefix([key(0)], soon()) == 1
        server.close()
        server.close()  # returns at once: the worker's shutdown may come twice


def test_a_connection_the_server_closed_while_idle_is_opened_again() -> None:
    with serving() as (server, client):
        c = client()
        assert c.held_prefix([key(0)], soon()) == 1
        with server._lock:
            for conn in server._conns.values():
                conn.sock.shutdown(socket.SHUT_RDWR)
        wait_for(lambda: server.num_connections == 0, what="the idle connection closed")
        assert c.held_prefix([key(0), key(1)], soon()) == 2
        assert isinstance(pull(c, 2)[0], StoredChunk)


# -- CURVE -----------------------------------------------------------------------------------


def certificate(tmp_path: Path, name: str) -> str:
    zmq.auth.create_certificates(str(tmp_path), name)
    path = tmp_path / f"{name}.key_secret"
    path.chmod(0o600)
    return str(path)


def test_curve_peers_share_one_certificate_and_the_public_key_alone_gets_nothing(
    tmp_path: Path,
) -> None:
    """With the deployment's certificate on both sides a pull works. A client without CURVE,
    with another certificate, or (F13) with the deployment's public key and a key pair of its
    own completes no handshake: it learns nothing. A certificate others can read is refused."""
    keys = shared_curve(certificate(tmp_path, "peers"))
    assert keys is not None
    other = shared_curve(certificate(tmp_path, "other"))
    assert other is not None
    public, secret = zmq.curve_keypair()
    public_only = CurveClientKeys(keys[0].public, public, secret)
    server = CurvePeerServer("127.0.0.1", 0, HELLO, served(), keys[0], 5.0)

    def client(curve: CurveClientKeys) -> CurvePeerClient:
        return CurvePeerClient("127.0.0.1", server.port, 1, 0, NS, None, curve, PAYLOAD)

    clients = [client(c) for c in (keys[1], other[1], public_only)]
    try:
        ok, stranger, impostor = clients
        assert ok.held_prefix([key(0), key(1)], soon()) == 2
        found = pull(ok, 1)[0]
        assert isinstance(found, StoredChunk) and torch.equal(found.data, CHUNKS[key(1)][1])
        for c in (stranger, impostor):
            with pytest.raises(TierUnavailable, match="did not answer"):
                c.held_prefix([key(0)], Deadline(0.5))
        plain = TcpPeerClient("127.0.0.1", server.port, 1, 0, NS, None, PAYLOAD)
        with pytest.raises(TierError):
            plain.held_prefix([key(0)], Deadline(0.5))
    finally:
        for c in clients:
            c.close()
        server.close()
    readable = tmp_path / "peers.key_secret"
    readable.chmod(0o644)
    with pytest.raises(ValueError, match=r"peers\.key_secret"):
        shared_curve(str(readable))


PROBE = """
import sys
from kvconnect.connector.offload.peers.curve import CurvePeerClient, shared_curve
from kvconnect.connector.offload.peers.protocol import Deadline
keys = shared_curve(sys.argv[1])
for port in sys.argv[2:]:
    for _ in range(5):
        c = CurvePeerClient("127.0.0.1", int(port), 1, 0, "ns", None, keys[1])
        try:
            c.held_prefix(["ns/1/0/{00}"], Deadline(0.2))
        except Exception:
            pass
        c.close()
print("alive")
"""


def test_a_curve_client_meeting_listeners_that_are_not_peers_survives(tmp_path: Path) -> None:
    """F1 under CURVE: libzmq refuses a peer that is not ZMTP 3 with CURVE at the handshake,
    so no byte of an HTTP answer, ZMTP/1.0 frames (the more flag set, then the connection
    closed) or random bytes is decoded as frames (in a process of its own: an abort in
    libzmq would kill pytest)."""
    cert = certificate(tmp_path, "peers")
    greetings = [
        b"HTTP/1.1 400 Bad Request\r\nContent-Length: 11\r\nConnection: close\r\n\r\nBad Request",
        b"\x03\x01ab\x03\x01cd\x02\x00e",
        bytes(range(256)) * 4,
    ]
    with contextlib.ExitStack() as stack:
        peers = [stack.enter_context(fake_peer(greeting=g, hold=False)) for g in greetings]
        done = subprocess.run(
            [sys.executable, "-c", PROBE, cert, *(str(p.port) for p in peers)],
            capture_output=True,
            timeout=60,
        )
    assert done.returncode == 0 and b"alive" in done.stdout, done.stderr[-2000:]


def test_peer_traffic_is_signed_whenever_the_deployment_has_a_secret(tmp_path: Path) -> None:
    """The peer config's hmac_key_file, else a tier's (the same deployment secret), else one
    derived from the CURVE certificate every peer holds; none of them: unsigned."""

    def secret(name: str, value: bytes) -> str:
        path = tmp_path / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(value)
        return str(path)

    peer_key, tier_key = secret("peer.key", b"p" * 32), secret("tier.key", b"t" * 32)
    cert = certificate(tmp_path, "peers")

    def keys(peer: dict[str, Any], tier: dict[str, Any]) -> PeerKeys:
        disk = {"kind": "disk", "path": str(tmp_path / "disk"), **tier}
        extra = {"tiers": [{"kind": "cpu"}, disk], "peer": {"port": 7100, **peer}}
        return PeerKeys.from_config(OffloadConfig.from_extra_config(extra, 16))

    assert keys({"hmac_key_file": peer_key}, {"hmac_key_file": tier_key}).mac == b"p" * 32
    assert keys({}, {"hmac_key_file": tier_key}).mac == b"t" * 32
    derived = keys({"curve_secret_key_file": cert}, {})
    assert derived.curve is not None and derived.mac is not None and len(derived.mac) == 32
    assert keys({"curve_secret_key_file": cert}, {}).mac == derived.mac  # every peer alike
    assert keys({}, {}).mac is None
