"""Issue 34 ("Trust boundaries, round two"), the relay's half: a real `kvconnect router`
process in front of an instance written here, which answers completions with whatever bytes a
test gives it. Bad framing from an instance is never passed on (finding 10, and 11 in the
answer's direction), a cut answer never looks whole to the client (finding 5), a chunk is
relayed in bounded pieces however large the instance says it is (finding 9), and a client that
reads slowly does not put the instance on the clock (finding 8)."""

from __future__ import annotations

import contextlib
import json
import socket
import socketserver
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ..helpers import free_port, wait_for
from ..serving import RouterProcess, get

Answer = Callable[[socket.socket], None]


class RawInstance:
    """/health is 200; a POST is answered by `answer(sock)` (raw bytes), then the connection
    closes. Notes when writing to the router failed (the router cut it)."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.cut = threading.Event()
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                sock: socket.socket = self.request
                reader = sock.makefile("rb")
                with contextlib.suppress(OSError):
                    while head := _read_head(reader):
                        length = int(head.get(b"content-length", b"0"))
                        reader.read(length)
                        if head[b":method"] == b"GET":
                            sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                            continue
                        try:
                            outer.answer(sock)
                        except OSError:
                            outer.cut.set()
                        return

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        port = self.server.server_address[1]
        self.instance = f"http://127.0.0.1:{port},tcp://127.0.0.1:{free_port()}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _read_head(reader: object) -> dict[bytes, bytes]:
    line = reader.readline()  # type: ignore[attr-defined]
    if not line:
        return {}
    head = {b":method": line.split(b" ", 1)[0]}
    while (field := reader.readline()) not in (b"\r\n", b""):  # type: ignore[attr-defined]
        name, _, value = field.partition(b":")
        head[name.strip().lower()] = value.strip()
    return head


@contextlib.contextmanager
def routed(
    tmp_path: Path, answer: Answer, *flags: str
) -> Iterator[tuple[RouterProcess, RawInstance]]:
    instance = RawInstance(answer)
    router = RouterProcess(tmp_path, [], "--instance", instance.instance, *flags)
    router.start()
    try:
        wait_for(lambda: get(f"{router.url}/health")[0] == 200, timeout=30, what="instance up")
        yield router, instance
    finally:
        assert router.stop() == 0, router.logs()
        instance.stop()
    assert "Traceback" not in router.logs(), router.logs()


Pair = tuple[RouterProcess, RawInstance]


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """One router and instance for the tests that set their own answer (a router start costs
    about a second)."""
    with routed(tmp_path_factory.mktemp("relay"), lambda s: None) as pair:
        yield pair


@contextlib.contextmanager
def answering(pair: Pair, answer: Answer) -> Iterator[Pair]:
    """The shared pair with the instance answering `answer`, once the instance is in rotation
    again (a malformed answer takes it out until its next health check)."""
    router, instance = pair
    instance.answer = answer
    wait_for(lambda: get(f"{router.url}/health")[0] == 200, timeout=30, what="instance up")
    yield pair


def ask(port: int, stream: bool = False, rcvbuf: int = 0) -> socket.socket:
    body = json.dumps({"model": "tiny", "prompt": "hello", "stream": stream}).encode()
    s = socket.socket()
    s.settimeout(30)
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
    return s


def read_to_close(s: socket.socket) -> bytes:
    got = bytearray()
    while data := s.recv(1 << 16):
        got += data
    return bytes(got)


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        # Before: relayed as a 200 with the body cut to nothing.
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n{}", b"Content-Length"),
        # Before: a 500 (int('abc') in the relay).
        (b"HTTP/1.1 200 OK\r\nContent-Length: abc\r\n\r\n{}", b"Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", b"Duplicate"),
        (b"HTTP/1.1 200 OK\r\nX: a\x01b\r\nContent-Length: 2\r\n\r\n{}", b"header value"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}", b""),
    ],
)
def test_a_malformed_answer_head_is_a_502_never_relayed(
    shared: Pair, raw: bytes, why: bytes
) -> None:
    with answering(shared, lambda s: s.sendall(raw)) as (router, _):
        with ask(router.port) as s:
            answer = read_to_close_or_whole(s)
        assert status_of(answer) == 502, answer
        assert b"malformed answer" in answer and why in answer, answer
        assert "malformed answer" in router.logs()


def read_to_close_or_whole(s: socket.socket) -> bytes:
    """An answer with Content-Length, read whole (the router keeps the connection open)."""
    got = bytearray()
    while b"\r\n\r\n" not in got:
        got += s.recv(1 << 16)
    head, _, body = bytes(got).partition(b"\r\n\r\n")
    length = int(
        next(
            v
            for k, _, v in (f.partition(b": ") for f in head.split(b"\r\n"))
            if k.lower() == b"content-length"
        )
    )
    while len(body) < length:
        body += s.recv(1 << 16)
    return head + b"\r\n\r\n" + body


def test_an_interim_100_continue_is_skipped_and_the_final_answer_relayed(shared: Pair) -> None:
    """Before: the 100 was relayed as the final status (and the real answer lost)."""
    final = b'{"choices": [{"text": "ok"}]}'
    raw = (
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
        % (len(final), final)
    )
    with answering(shared, lambda s: s.sendall(raw)) as (router, _), ask(router.port) as s:
        answer = read_to_close_or_whole(s)
    assert status_of(answer) == 200 and answer.endswith(final), answer
    assert b"\r\nLink:" not in answer


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
EVENT = b'data: {"choices": [{"text": "a"}]}\n\n'


@pytest.mark.parametrize(
    "tail",
    [
        b"",  # the instance closes mid-stream
        b"5;a\nb\r\nhello\r\n0\r\n\r\n",  # a bare LF in a chunk extension (finding 11)
        b"5 \r\nhello\r\n0\r\n\r\n",  # whitespace after a chunk size
        b"zz\r\nhello\r\n0\r\n\r\n",  # not a chunk size
    ],
)
def test_a_cut_or_badly_framed_stream_ends_with_an_error_event_and_no_last_chunk(
    shared: Pair, tail: bytes
) -> None:
    """Before: the router ended the client's answer with 0-CRLF-CRLF, as a whole answer ends,
    and passed the malformed chunk lines on as data."""
    raw = SSE_HEAD + b"%x\r\n%b\r\n" % (len(EVENT), EVENT) + tail
    with answering(shared, lambda s: s.sendall(raw)) as (router, _):
        with ask(router.port, stream=True) as s:
            answer = read_to_close(s)
        assert status_of(answer) == 200
        assert EVENT in answer and b"hello" not in answer, answer
        assert b'data: {"error": {"message": "' in answer and b"failed mid-answer" in answer
        assert not answer.endswith(b"0\r\n\r\n"), answer  # no last chunk: never whole
        assert "failed mid-answer" in router.logs()


def _vmhwm_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def test_a_huge_chunk_is_relayed_in_bounded_pieces(shared: Pair) -> None:
    """The instance announces one 64 MiB chunk. Before, the router read the whole chunk
    before passing any of it on (its memory grew by the chunk's size: +300 MiB for 300 MiB in
    the review): the client got nothing of it until all had come. Now the first MiB reaches
    the client while the instance still holds the rest back, and the router's peak memory
    grows by far less than the chunk."""
    size = 64 << 20
    first = 1 << 20
    go = threading.Event()
    block = bytes(range(256)) * 4096  # 1 MiB

    def answer(s: socket.socket) -> None:
        s.sendall(SSE_HEAD + b"%x\r\n" % size + block)
        go.wait(60)
        for _ in range(size // len(block) - 1):
            s.sendall(block)
        s.sendall(b"\r\n0\r\n\r\n")

    with answering(shared, answer) as (router, _):
        assert router.proc is not None
        before = _vmhwm_kib(router.proc.pid)
        with ask(router.port, stream=True) as s:
            got = bytearray()
            while len(got) < first // 2:  # half of the first MiB, at least
                data = s.recv(1 << 16)
                assert data, got[-200:]
                got += data
            go.set()
            got += read_to_close_until_last_chunk(s)
        grew_mib = (_vmhwm_kib(router.proc.pid) - before) / 1024
    body = bytes(got).partition(b"\r\n\r\n")[2]
    assert _unchunk(body) == block * (size // len(block))
    assert grew_mib < 24, f"the router's peak memory grew by {grew_mib:.0f} MiB"


def read_to_close_until_last_chunk(s: socket.socket) -> bytes:
    got = bytearray()
    while not got.endswith(b"\r\n0\r\n\r\n"):
        data = s.recv(1 << 20)
        assert data, got[-200:]
        got += data
    return bytes(got)


def _unchunk(body: bytes) -> bytes:
    out, at = bytearray(), 0
    while True:
        end = body.index(b"\r\n", at)
        size = int(body[at:end], 16)
        if size == 0:
            return bytes(out)
        out += body[end + 2 : end + 2 + size]
        at = end + 4 + size


def test_a_slow_client_does_not_put_the_instance_on_the_clock(tmp_path: Path) -> None:
    """--upstream-timeout 1: the instance streams 32 MiB as fast as it can; the client reads
    nothing for three times that. Before, the instance's deadline ran while the router waited
    on its own client: after 1 s the router cut the stream and took a healthy instance out of
    rotation ("stalled"). Now the instance is timed only while the router waits on it."""
    event = b"data: " + b"x" * 8186 + b"\n\n"  # 8 KiB
    count = 4096  # 32 MiB: far more than the socket buffers and the router hold

    def answer(s: socket.socket) -> None:
        s.sendall(SSE_HEAD)
        for _ in range(count):
            s.sendall(b"%x\r\n%b\r\n" % (len(event), event))
        s.sendall(b"0\r\n\r\n")

    with routed(tmp_path, answer, "--upstream-timeout", "1") as (router, instance):
        with ask(router.port, stream=True, rcvbuf=4096) as s:
            # Waits for the cut that must not come; on the code before it came after ~1 s.
            assert not instance.cut.wait(3.5), router.logs()
            answer_bytes = read_to_close_until_last_chunk(s)
        body = _unchunk(answer_bytes.partition(b"\r\n\r\n")[2])
        assert body == event * count
        assert "stalled" not in router.logs(), router.logs()
        status, health = get(f"{router.url}/health")
        assert status == 200, health
