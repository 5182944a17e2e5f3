"""The peer tier's transport (`tiers/peer.py`) over real ZMQ sockets on loopback: a chunk
pulled bit-exact, refusals on both sides, and every forged answer refused before use."""

from __future__ import annotations

import contextlib
import math
import re
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import zmq
import zmq.auth

from kvconnect.connector.offload.common import ChunkInfo, chunk_key
from kvconnect.connector.offload.tiers.base import (
    IntegrityError,
    StoredChunk,
    TierError,
    TierPlacement,
    TierUnavailable,
    pack,
)
from kvconnect.connector.offload.tiers.peer import (
    MAX_DATA_CONNECTIONS,
    MAX_KEYS,
    PeerClient,
    PeerServer,
    RecvBuffers,
    shared_curve,
)
from tests.helpers import wait_for

NS = "tiny@0123456789abcdef"
SHAPE = (2, 2, 32, 1, 4)
PLACEMENT = TierPlacement(1, 0, SHAPE, torch.float32, NS)
MAC = b"k" * 32


def info(i: int) -> ChunkInfo:
    return ChunkInfo(
        bytes([i]) * 32, (i * 10, i * 10 + 1), None if i == 0 else i * 10 - 9, tuple(range(32)), 16
    )


def key(i: int, rank: int = 0, world: int = 1) -> str:
    return chunk_key(NS, world, rank, info(i).last_block_hash)


CHUNKS = {key(i): (info(i), torch.randn(SHAPE)) for i in range(3)}


@contextmanager
def serving(
    mac: bytes | None = None,
    world: int = 1,
    rank: int = 0,
    chunks: dict[str, tuple[ChunkInfo, torch.Tensor]] = CHUNKS,
    **settle: Any,
) -> Iterator[tuple[PeerServer, Callable[..., PeerClient]]]:
    def held(keys: list[str]) -> int:
        n = 0
        while n < len(keys) and keys[n] in chunks:
            n += 1
        return n

    def read(k: str) -> list[object] | None:
        found = chunks.get(k)
        return None if found is None else list(pack(k, *found, mac))  # as a worker sends it

    server = PeerServer("tcp://127.0.0.1:0", world, rank, NS, held, read, **settle)
    clients: list[PeerClient] = []

    def client(**kw: object) -> PeerClient:
        args: dict[str, object] = {"timeout_s": 5.0, **kw}
        c = PeerClient(server.endpoint, 1, 0, NS, **args)  # type: ignore[arg-type]
        clients.append(c)
        return c

    try:
        yield server, client
    finally:
        for c in clients:
            c.close()
        server.close()


def test_a_chunk_is_pulled_bit_exact_and_a_miss_is_none() -> None:
    with serving(MAC) as (_, client):
        c = client(mac_key=MAC)
        c.hello()
        assert c.held_prefix([key(0), key(1), key(7), key(2)]) == 2
        found = c.fetch(key(1), info(1), PLACEMENT)
        assert found is not None and found.info == info(1)
        assert torch.equal(found.data, CHUNKS[key(1)][1])
        assert c.fetch(key(7), info(7), PLACEMENT) is None


def test_a_has_naming_a_chunk_being_stored_is_answered_once_stored_holding_up_nobody() -> None:
    """A P/D prefill answers before its chunks are stored: a HAS naming one still on its way
    waits for it (up to `settle_s`), while the server answers every other request."""
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
        thread = threading.Thread(target=lambda: got.append(waiting.held_prefix(wanted)))
        thread.start()
        assert asked.wait(5)  # held back now
        other.hello()
        assert other.held_prefix([key(0), key(1)]) == 2
        assert other.fetch(key(1), info(1), PLACEMENT) is not None
        assert thread.is_alive() and got == []
        chunks[key(3)] = (info(3), torch.randn(SHAPE))  # its store is done
        thread.join(10)
        assert got == [4]


def test_a_has_held_back_past_settle_s_is_answered_with_what_is_held() -> None:
    with serving(settling=lambda keys: True, settle_s=0.2) as (_, client):
        assert client().held_prefix([key(0), key(1), key(2), key(3)]) == 3


def test_another_tp_size_is_refused_naming_both() -> None:
    with serving(world=2) as (server, _):
        c = PeerClient(server.endpoint, 1, 0, NS, timeout_s=5.0)
        try:
            with pytest.raises(ValueError, match="tensor-parallel size 2, this instance 1"):
                c.hello()
        finally:
            c.close()


def raw(endpoint: str, *frames: bytes) -> list[bytes]:
    with zmq.Context.instance().socket(zmq.DEALER) as s:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        s.send_multipart(list(frames))
        assert s.poll(5000), "no answer"
        return s.recv_multipart()


@pytest.mark.parametrize(
    ("frames", "says"),
    [
        ([b"12345678", b"DROP", b""], b"unknown verb"),
        ([b"12345678", b"HAS", b"\xc1"], b"not a msgpack list"),
        ([b"12345678", b"HAS", msgspec.msgpack.encode([key(0)] * (MAX_KEYS + 1))], b"at most"),
        ([b"12345678", b"GET", key(0, rank=1, world=2).encode()], b"not one of this rank's"),
        ([b"12345678", b"GET", b"\xff"], b"ASCII"),
        ([b"12345678", b"GET"], b"[id, verb, argument]"),
    ],
)
def test_a_bad_request_is_refused_naming_why_and_the_server_serves_on(
    frames: list[bytes], says: bytes
) -> None:
    with serving() as (server, client):
        rid, status, why = raw(server.endpoint, *frames)
        assert (rid, status) == (b"12345678", b"ERR") and says in why, why
        assert server.num_refused == 1
        assert client().held_prefix([key(0)]) == 1


@contextmanager
def forger(answer: Callable[[bytes, bytes], list[bytes]]) -> Iterator[str]:
    """A peer of the test: `answer(verb, argument)` is sent back as [status, payload...]."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            if sock.poll(20):
                ident, rid, verb, arg = sock.recv_multipart()
                reply = answer(verb, arg)
                if reply:
                    sock.send_multipart([ident, rid, *reply])

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        stop.set()
        thread.join(5)
        sock.close()


def chunk_bytes(k: str, i: int, mac: bytes | None = None, **changes: object) -> bytes:
    meta, data = CHUNKS[key(i)]
    fields = {**meta.__dict__, **changes}
    return b"".join(pack(k, ChunkInfo(**fields), data, mac))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("blob", "mac", "says"),
    [
        (lambda: chunk_bytes(key(2), 2), None, "entry holds"),  # chunk 2 sent as chunk 1
        (lambda: chunk_bytes(key(1), 1, token_ids=tuple(range(1, 33))), None, "token ids"),
        (lambda: chunk_bytes(key(1), 1, parent_block_hash=5), None, "parent hash"),
        (lambda: chunk_bytes(key(1), 1)[:-1] + b"\x00", None, "checksum"),
        (lambda: chunk_bytes(key(1), 1), MAC, "unsigned"),
        (lambda: chunk_bytes(key(1), 1, b"x" * 32), MAC, "wrong signature"),
        (lambda: b"not a chunk", None, "bad magic"),
    ],
)
def test_a_forged_chunk_is_refused_before_use(
    blob: Callable[[], bytes], mac: bytes | None, says: str
) -> None:
    def answer(verb: bytes, arg: bytes) -> list[bytes]:
        return [b"OK", blob()]

    with forger(answer) as endpoint:
        c = PeerClient(endpoint, 1, 0, NS, mac_key=mac, timeout_s=5.0)
        try:
            with pytest.raises(IntegrityError, match=says):
                c.fetch(key(1), info(1), PLACEMENT)
        finally:
            c.close()


def test_a_chunk_in_parts_with_a_changed_payload_is_refused() -> None:
    """As a worker sends a chunk (pack's parts, one frame each), its payload changed after it
    was packed (a cpu slot reused while it was being sent): the checksum refuses it."""

    def answer(verb: bytes, arg: bytes) -> list[bytes]:
        parts = [bytes(p) for p in pack(key(1), *CHUNKS[key(1)])]
        parts[3] = b"\0" * len(parts[3])
        return [b"OK", *parts]

    with forger(answer) as endpoint:
        c = PeerClient(endpoint, 1, 0, NS, timeout_s=5.0)
        try:
            with pytest.raises(IntegrityError, match="checksum mismatch"):
                c.fetch(key(1), info(1), PLACEMENT)
        finally:
            c.close()


def test_a_reply_over_the_bound_is_never_taken() -> None:
    """ZMQ drops the connection of a peer whose message is over MAXMSGSIZE: a timeout."""

    def answer(verb: bytes, arg: bytes) -> list[bytes]:
        return [b"OK", b"x" * (1 << 20)]

    with forger(answer) as endpoint:
        c = PeerClient(endpoint, 1, 0, NS, timeout_s=0.5, max_reply_bytes=1 << 16)
        try:
            with pytest.raises(TierUnavailable, match="did not answer"):
                c.fetch(key(1), info(1), PLACEMENT)
        finally:
            c.close()


def test_a_late_answer_is_never_taken_for_the_next_request() -> None:
    """The first HAS gets no answer in time; with the answer to the next, the peer sends the
    first one's too (3), before it: the client reads the next one's (1)."""
    first: list[bytes] = []
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    c = PeerClient(f"tcp://127.0.0.1:{port}", 1, 0, NS, timeout_s=0.2)
    try:
        with pytest.raises(TierUnavailable, match=r"did not answer in 0\.2 s"):
            c.held_prefix([key(0), key(1), key(2)])
        assert sock.poll(5000)
        first = sock.recv_multipart()
        done = threading.Event()

        def answer_late() -> None:
            assert sock.poll(5000)
            ident, rid, _, _ = sock.recv_multipart()
            sock.send_multipart([ident, first[1], b"OK", msgspec.msgpack.encode(3)])
            sock.send_multipart([ident, rid, b"OK", msgspec.msgpack.encode(1)])
            done.set()

        thread = threading.Thread(target=answer_late, daemon=True)
        thread.start()
        c.timeout_ms = 5000
        assert c.held_prefix([key(0), key(1), key(2)]) == 1
        assert done.wait(5)
    finally:
        c.close()
        sock.close()


def test_an_err_answer_is_a_tier_error_naming_it() -> None:
    def answer(verb: bytes, arg: bytes) -> list[bytes]:
        return [b"ERR", b"no such thing"]

    with forger(answer) as endpoint:
        c = PeerClient(endpoint, 1, 0, NS, timeout_s=5.0)
        try:
            with pytest.raises(TierError, match="refused HAS: no such thing"):
                c.held_prefix([key(0)])
        finally:
            c.close()


def test_a_server_closes_once_and_a_second_close_does_nothing() -> None:
    with serving() as (server, client):
        assert client().held_prefix([key(0)]) == 1
        server.close()
        server.close()  # returns at once: the worker's shutdown may come twice


def certificate(tmp_path: Path, name: str) -> str:
    zmq.auth.create_certificates(str(tmp_path), name)
    path = tmp_path / f"{name}.key_secret"
    path.chmod(0o600)
    return str(path)


def test_curve_peers_share_one_certificate_and_others_get_nothing(tmp_path: Path) -> None:
    """With the deployment's certificate on both sides a pull works; a client without CURVE,
    or with another certificate, completes no handshake: it learns nothing, and fails in its
    timeout. A certificate others can read is refused, named."""
    keys = shared_curve(certificate(tmp_path, "peers"))
    assert keys is not None
    other = shared_curve(certificate(tmp_path, "other"))
    assert other is not None
    server = PeerServer(
        "tcp://127.0.0.1:0",
        1,
        0,
        NS,
        lambda k: len(k),
        lambda k: list(pack(k, *CHUNKS[k])),
        curve=keys[0],
    )
    clients = [
        PeerClient(server.endpoint, 1, 0, NS, timeout_s=0.5, curve=curve)
        for curve in (keys[1], None, other[1])
    ]
    try:
        ok, plain, stranger = clients
        ok.hello()
        found = ok.fetch(key(1), info(1), PLACEMENT)
        assert found is not None and torch.equal(found.data, CHUNKS[key(1)][1])
        for c in (plain, stranger):
            with pytest.raises(TierUnavailable, match="did not answer"):
                c.held_prefix([key(0)])
    finally:
        for c in clients:
            c.close()
        server.close()
    readable = tmp_path / "peers.key_secret"
    readable.chmod(0o644)
    with pytest.raises(ValueError, match=r"peers\.key_secret"):
        shared_curve(str(readable))


def test_a_source_that_dies_mid_pull_fails_the_rest_of_it_in_its_timeout() -> None:
    """The source serves chunk 0, then never answers again: the pull yields chunk 0 checked,
    then the timeout for every chunk left (recomputed by the worker), and the server,
    released, closes."""
    hang = threading.Event()

    def read(k: str) -> list[object] | None:
        if k != key(0):
            hang.wait(30)  # stuck until the test ends
        return list(pack(k, *CHUNKS[k]))

    server = PeerServer("tcp://127.0.0.1:0", 1, 0, NS, lambda ks: len(ks), read)
    client = PeerClient(server.endpoint, 1, 0, NS, timeout_s=0.5)
    try:
        got = list(client.fetch_many([(key(i), info(i)) for i in range(3)], PLACEMENT))
        assert isinstance(got[0], StoredChunk) and torch.equal(got[0].data, CHUNKS[key(0)][1])
        assert all(isinstance(g, TierUnavailable) for g in got[1:]), got
        assert "did not answer in 0.5 s" in str(got[1])
    finally:
        hang.set()
        client.close()
        server.close()


# -- the data port ---------------------------------------------------------------------------


def test_a_pull_reads_its_chunks_over_the_data_port_into_the_buffers_it_is_given() -> None:
    """Three chunks and a miss over the data port, bit-exact, each chunk's data in the
    buffers given (in turn): a chunk stays intact until two more have been read."""
    with serving(MAC) as (server, client):
        assert server.data is not None
        c = client(mac_key=MAC)
        size = math.prod(SHAPE) * 4
        buffers = RecvBuffers(size)
        wanted = [(key(i), info(i)) for i in (0, 1, 2, 7)]
        pulls = c.fetch_many(wanted, PLACEMENT, buffers)
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
        assert c._data is not None
        again = list(c.fetch_many(wanted[:1], PLACEMENT))  # no buffers: memory of its own
        assert isinstance(again[0], StoredChunk)
        assert torch.equal(again[0].data, CHUNKS[key(0)][1])


def data_request(port: int, payload: bytes) -> bytes:
    """`payload` sent raw to a data port; everything it answers until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(payload)
        got = b""
        while chunk := s.recv(1 << 16):
            got += chunk
        return got


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        ((0).to_bytes(4, "big"), b"a key is 1-512 bytes"),
        ((1 << 20).to_bytes(4, "big"), b"a key is 1-512 bytes"),
        (b"\x00\x00\x00\x01\xff", b"a key is ASCII"),
        (len(k := key(0, 1, 2).encode()).to_bytes(4, "big") + k, b"not one of this rank's"),
    ],
)
def test_a_bad_data_port_request_is_refused_and_closed_and_the_server_serves_on(
    payload: bytes, says: bytes
) -> None:
    with serving() as (server, client):
        assert server.data is not None
        answer = data_request(server.data.port, payload)
        assert answer[:2] == b"E\x01" and says in answer[10:], answer
        got = list(client().fetch_many([(key(1), info(1))], PLACEMENT))
        assert isinstance(got[0], StoredChunk)


def test_the_data_port_holds_a_bounded_number_of_connections() -> None:
    with serving() as (server, client):
        assert server.data is not None
        idle = [
            socket.create_connection(("127.0.0.1", server.data.port))
            for _ in range(MAX_DATA_CONNECTIONS + 1)
        ]
        try:
            last = idle[-1]
            last.settimeout(5)
            assert last.recv(1) == b""  # one over the bound: closed at once
            idle.pop().close()
            idle.pop().close()  # room for one more
            wait_for(lambda: len(server.data._conns) < MAX_DATA_CONNECTIONS, what="a slot")  # type: ignore[union-attr]
            got = list(client().fetch_many([(key(1), info(1))], PLACEMENT))
            assert isinstance(got[0], StoredChunk)
        finally:
            for s in idle:
                s.close()


@contextmanager
def data_forger(answer: bytes) -> Iterator[str]:
    """A peer whose HELLO names a data port that sends `answer` to every request."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    hello = msgspec.msgpack.encode([1, 0, NS, listener.getsockname()[1]])

    def serve_data() -> None:
        with contextlib.suppress(OSError):
            conn, _ = listener.accept()
            with conn:
                conn.recv(4 + len(key(1)))
                conn.sendall(answer)
                conn.recv(1)  # until the client closes

    def hello_only(verb: bytes, arg: bytes) -> list[bytes]:
        return [b"OK", hello]

    thread = threading.Thread(target=serve_data, daemon=True)
    thread.start()
    try:
        with forger(hello_only) as endpoint:
            yield endpoint
    finally:
        listener.close()
        thread.join(5)


def parts_answer(*parts: bytes, status: bytes = b"K") -> bytes:
    return (
        status
        + bytes([len(parts)])
        + b"".join(len(p).to_bytes(8, "big") for p in parts)
        + b"".join(parts)
    )


@pytest.mark.parametrize(
    ("answer", "error", "says"),
    [
        (b"Z\x00", TierError, "not a data-port answer"),
        (b"K\x09", TierError, "not a data-port answer"),
        (parts_answer(b"a", b"b"), TierError, "an answer of 2 parts"),
        (parts_answer(b"h", b"h", b"h", b"x" * (1 << 17)), TierError, "a part of 131072 bytes"),
        (
            b"K\x04" + b"".join(n.to_bytes(8, "big") for n in (1, 1, 1, 1 << 40)) + b"hhh",
            TierError,
            "a part of 1099511627776 bytes",
        ),
        (
            parts_answer(b"h", b"h", b"h", b"x" * 64)[:-10],
            TierUnavailable,
            "closed after|reset by peer",
        ),
        (parts_answer(b"nope", status=b"E"), TierError, "refused GET .*: nope"),
    ],
)
def test_a_data_port_answer_framed_badly_is_never_taken(
    answer: bytes, error: type[TierError], says: str
) -> None:
    """Each bad answer fails the chunk it came for and the rest of the pull (the connection
    is closed: nothing after it can be trusted to be in step)."""
    with data_forger(answer) as endpoint:
        c = PeerClient(endpoint, 1, 0, NS, timeout_s=2.0, max_reply_bytes=1 << 16)
        try:
            got = list(c.fetch_many([(key(1), info(1)), (key(2), info(2))], PLACEMENT))
            assert all(isinstance(g, error) for g in got), got
            assert re.search(says, str(got[0])), got
            assert c._data is None
        finally:
            c.close()


def test_with_curve_there_is_no_data_port(tmp_path: Path) -> None:
    keys = shared_curve(certificate(tmp_path, "peers"))
    assert keys is not None
    server = PeerServer(
        "tcp://127.0.0.1:0", 1, 0, NS, len, lambda k: list(pack(k, *CHUNKS[k])), curve=keys[0]
    )
    c = PeerClient(server.endpoint, 1, 0, NS, timeout_s=2.0, curve=keys[1])
    try:
        assert server.data is None
        got = list(c.fetch_many([(key(1), info(1))], PLACEMENT))
        assert isinstance(got[0], StoredChunk) and torch.equal(got[0].data, CHUNKS[key(1)][1])
        assert c._data is None
    finally:
        c.close()
        server.close()
