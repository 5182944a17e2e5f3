"""`http/h1_server.py`, the router's HTTP/1.1 server, over real loopback sockets: what it
reads, what it refuses, how it frames answers, its deadlines and its cap. The router's own
behaviour through it (auth, limits, fuzz, relays) is tested on the `kvconnect router` process
elsewhere."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import threading
import zlib
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import pytest

from kvconnect.api.protocol import MAX_BODY_BYTES
from kvconnect.http.auth import BearerAuth
from kvconnect.http.h1_server import H1Server, Request, Response, json_response
from kvconnect.http.limits import ConnectionLimits

from ..helpers import wait_for


class App:
    """Handlers that say what they saw; `cancelled` is set when a stream's client left."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.streaming = threading.Event()
        self.closed: list[str] = []

    async def echo(self, req: Request) -> Response:
        return json_response(
            {"method": req.method, "path": req.path, "query": req.query, "body": req.body.decode()}
        )

    async def split(self, _: Request) -> Response:
        """Headers as an instance's answer could carry them, one with a line break in it."""
        return Response(200, b"{}", headers={"X-Ok": "yes", "X-Evil": "a\r\nSet-Cookie: s=1"})

    async def fail(self, _: Request) -> Response:
        raise RuntimeError("a bug")

    async def stream(self, req: Request) -> Response:
        async def pieces() -> AsyncIterator[bytes]:
            try:
                yield b"one"
                yield b""  # nothing to send: no empty chunk (that would end the body)
                yield b"two"
                if req.query == "hang":
                    self.streaming.set()
                    await asyncio.Event().wait()  # never set: until the client leaves
            except asyncio.CancelledError:
                self.cancelled.set()
                raise

        return Response(
            200,
            content_type="text/event-stream",
            stream=pieces(),
            on_close=lambda: self.closed.append(req.query),
        )

    async def cut(self, _: Request) -> Response:
        """A stream whose source fails after its first piece (an instance that died)."""

        async def pieces() -> AsyncIterator[bytes]:
            yield b"one"
            raise ConnectionError("the instance went away")

        return Response(200, content_type="text/event-stream", stream=pieces())

    def routes(self) -> dict[str, dict[str, object]]:
        return {
            "/echo": {"POST": self.echo, "GET": self.echo},
            "/fail": {"GET": self.fail},
            "/split": {"GET": self.split},
            "/stream": {"GET": self.stream},
            "/cut": {"GET": self.cut},
        }


@contextmanager
def serving(
    limits: ConnectionLimits | None = None, auth: BearerAuth | None = None
) -> Iterator[tuple[int, App, H1Server]]:
    app = App()
    loop = asyncio.new_event_loop()
    server = H1Server(app.routes(), limits or ConnectionLimits(), auth)  # type: ignore[arg-type]
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    loop.run_until_complete(server.start("127.0.0.1", port))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield port, app, server
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
    assert not server.open, "a connection outlived the server"


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    return s


def read_response(
    s: socket.socket, buffered: bytearray | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One response (Content-Length or chunked) from `s`; what follows stays in `buffered`."""
    buf = buffered if buffered is not None else bytearray()

    def fill() -> None:
        data = s.recv(1 << 16)
        if not data:
            raise ConnectionError("closed before the response ended")
        buf.extend(data)

    while b"\r\n\r\n" not in buf:
        fill()
    end = buf.index(b"\r\n\r\n")
    lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
    del buf[: end + 4]
    status = int(lines[0].split(" ")[1])
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    if status == 100:
        return read_response(s, buf)
    if "content-length" in headers:
        n = int(headers["content-length"])
        while len(buf) < n:
            fill()
        body = bytes(buf[:n])
        del buf[:n]
        return status, headers, body
    assert headers.get("transfer-encoding") == "chunked", headers
    body = b""
    while True:
        while b"\r\n" not in buf:
            fill()
        line_end = buf.index(b"\r\n")
        size = int(bytes(buf[:line_end]), 16)
        while len(buf) < line_end + 2 + size + 2:
            fill()
        body += bytes(buf[line_end + 2 : line_end + 2 + size])
        assert buf[line_end + 2 + size : line_end + 4 + size] == b"\r\n"
        del buf[: line_end + 4 + size]
        if size == 0:
            return status, headers, body


def exchange(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    with connect(port) as s:
        s.sendall(raw)
        return read_response(s)


def closed_by_server(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_request_with_a_body_is_read_and_answered_with_its_length() -> None:
    with serving() as (port, _, _):
        body = b'{"x": 1}'
        status, headers, answer = exchange(
            port, b"POST /echo?a=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 8\r\n\r\n" + body
        )
        assert status == 200 and headers["content-type"] == "application/json"
        assert int(headers["content-length"]) == len(answer)
        assert json.loads(answer) == {
            "method": "POST",
            "path": "/echo",
            "query": "a=1",
            "body": '{"x": 1}',
        }


def test_keep_alive_requests_pipelined_in_one_write_are_answered_in_order() -> None:
    with serving() as (port, _, server), connect(port) as s:
        s.sendall(
            b"".join(
                b"POST /echo HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(b), b)
                for b in (b"first", b"second", b"third")
            )
        )
        buf = bytearray()
        bodies = [json.loads(read_response(s, buf)[2])["body"] for _ in range(3)]
        assert bodies == ["first", "second", "third"]
        assert len(server.open) == 1  # one connection, kept open


def test_a_body_arriving_byte_by_byte_and_a_head_split_anywhere_are_read_whole() -> None:
    raw = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
    with serving() as (port, _, _), connect(port) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(len(raw)):
            s.sendall(raw[i : i + 1])
        assert json.loads(read_response(s)[2])["body"] == "hello"


def test_empty_lines_before_a_request_line_are_skipped() -> None:
    """As RFC 9112 asks (some clients end a POST body with an extra CRLF)."""
    with serving() as (port, _, _), connect(port) as s:
        buf = bytearray()
        s.sendall(b"POST /echo HTTP/1.1\r\nContent-Length: 1\r\n\r\nx\r\n")
        assert read_response(s, buf)[0] == 200
        s.sendall(b"\r\nGET /echo HTTP/1.1\r\n\r\n")
        assert json.loads(read_response(s, buf)[2])["method"] == "GET"


def test_a_chunked_body_with_extensions_and_trailers_is_read_whole() -> None:
    chunked = b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: yes\r\n\r\n"
    head = b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    with serving() as (port, _, _), connect(port) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(head)
        for i in range(0, len(chunked), 3):  # split inside size lines, data and trailers
            s.sendall(chunked[i : i + 3])
        assert json.loads(read_response(s)[2])["body"] == "hello world"
        s.sendall(head + b"0\r\n\r\n")  # no trailers; the connection goes on
        assert json.loads(read_response(s)[2])["body"] == ""


@pytest.mark.parametrize(
    ("encoding", "compress"),
    [
        (b"gzip", gzip.compress),
        (b"deflate", zlib.compress),
        (b"deflate", lambda b: zlib.compress(b, wbits=-15)),
    ],
)
def test_gzip_and_deflate_bodies_are_decoded(encoding: bytes, compress: object) -> None:
    body = compress(b'{"prompt": "hi"}')  # type: ignore[operator]
    head = b"POST /echo HTTP/1.1\r\nContent-Encoding: %s\r\nContent-Length: %d\r\n\r\n"
    with serving() as (port, _, _):
        status, _, answer = exchange(port, head % (encoding, len(body)) + body)
        assert status == 200 and json.loads(answer)["body"] == '{"prompt": "hi"}'


def test_a_compressed_body_that_expands_past_the_limit_is_a_413() -> None:
    bomb = gzip.compress(b" " * (MAX_BODY_BYTES + 10))  # a few KiB on the wire
    head = b"POST /echo HTTP/1.1\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n"
    with serving() as (port, _, _):
        status, _, answer = exchange(port, head % len(bomb) + bomb)
        assert status == 413 and b"limit" in answer


@pytest.mark.parametrize(
    ("raw", "status", "says"),
    [
        (b"GET /echo HTTP/1.1\r\nHost : x\r\n\r\n", 400, b"Invalid header token"),
        (b"GET /echo HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n", 400, b"whitespace after header"),
        (b"GET /echo HTTP/2.0\r\n\r\n", 505, b"HTTP/1.0 and HTTP/1.1"),
        (b"GET http://elsewhere/echo HTTP/1.1\r\n\r\n", 400, b"origin form"),
        (b"GET /echo\r\n\r\n", 400, b"request line"),
        (
            b"POST /echo HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
            400,
            b"can't be present with Content-Length",
        ),
        (b"POST /echo HTTP/1.1\r\nContent-Length: 3, 4\r\n\r\n", 400, b"in Content-Length"),
        (
            b"POST /echo HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nab",
            400,
            b"Duplicate Content-Length",
        ),
        (b"POST /echo HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400, b"in Content-Length"),
        (b"POST /echo HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 501, b"only chunked"),
        (b"POST /echo HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501, b"only chunked"),
        (b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400, b"chunk size"),
        (
            b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n",
            400,
            b"after chunk data",
        ),
        (
            b"POST /echo HTTP/1.1\r\nContent-Encoding: br\r\nContent-Length: 2\r\n\r\nab",
            415,
            b"not supported",
        ),
        (b"POST /echo HTTP/1.1\r\nX: " + b"a" * (70 << 10) + b"\r\n\r\n", 431, b"over"),
        (
            b"POST /echo HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1),
            413,
            b"limit",
        ),
    ],
)
def test_a_request_that_cannot_be_read_safely_is_refused_and_its_connection_closed(
    raw: bytes, status: int, says: bytes
) -> None:
    with serving() as (port, _, server):
        with connect(port) as s:
            s.sendall(raw)
            got, headers, answer = read_response(s)
            assert (got, headers["connection"]) == (status, "close") and says in answer, answer
            assert json.loads(answer)["error"]["code"] is None
            assert closed_by_server(s)  # its side, at once; it reads on until the client's
        wait_for(lambda: not server.open)


def test_a_refused_body_still_being_sent_does_not_reset_the_answer_away() -> None:
    """The client sends a 5 MiB body it declared; the 413 comes at the head, and the bytes
    that follow are read and dropped, so the client reads its answer (no reset)."""
    body = b" " * (5 << 20)
    with serving() as (port, _, _), connect(port) as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body))
        s.sendall(body)  # all of it goes: the server keeps reading
        status, _, answer = read_response(s)
        assert status == 413 and b"limit" in answer


def test_expect_100_continue_is_answered_before_the_body() -> None:
    with serving() as (port, _, _), connect(port) as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
        assert s.recv(64).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        s.sendall(b"ok")
        assert json.loads(read_response(s)[2])["body"] == "ok"


def test_http_1_0_and_connection_close_end_the_connection_after_the_answer() -> None:
    with serving() as (port, _, _):
        for raw in (
            b"GET /echo HTTP/1.0\r\n\r\n",
            b"GET /echo HTTP/1.1\r\nConnection: close\r\n\r\n",
        ):
            with connect(port) as s:
                s.sendall(raw)
                status, headers, _ = read_response(s)
                assert status == 200 and headers["connection"] == "close"
                assert closed_by_server(s)


def test_unknown_paths_are_404_wrong_methods_405_and_head_is_a_get_without_body() -> None:
    with serving() as (port, _, _), connect(port) as s:
        buf = bytearray()
        s.sendall(b"GET /nothing HTTP/1.1\r\n\r\n")
        status, _, answer = read_response(s, buf)
        assert status == 404 and json.loads(answer)["error"]["message"] == "no route for /nothing"
        s.sendall(b"DELETE /echo HTTP/1.1\r\n\r\n")
        status, headers, answer = read_response(s, buf)
        assert status == 405 and headers["allow"] == "GET, POST"
        s.sendall(b"HEAD /echo HTTP/1.1\r\n\r\nGET /echo HTTP/1.1\r\n\r\n")
        head = s.recv(4096)
        while head.count(b"HTTP/1.1 200") < 2:  # the GET's answer follows the HEAD's at once
            head += s.recv(4096)
        first, _ = head.split(b"HTTP/1.1 200")[1:]
        length = int(first.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        assert first.endswith(b"\r\n\r\n") and length > 0  # the length, not the bytes


def test_a_handler_that_raises_is_a_500_and_the_connection_serves_on() -> None:
    with serving() as (port, _, _), connect(port) as s:
        buf = bytearray()
        s.sendall(b"GET /fail HTTP/1.1\r\n\r\nGET /echo HTTP/1.1\r\n\r\n")
        status, _, answer = read_response(s, buf)
        assert status == 500 and json.loads(answer)["error"]["type"] == "internal_error"
        assert read_response(s, buf)[0] == 200


def test_bearer_auth_guards_every_path_but_health() -> None:
    with serving(auth=BearerAuth("k")) as (port, _, _):
        status, headers, answer = exchange(port, b"GET /echo HTTP/1.1\r\n\r\n")
        assert status == 401 and headers["www-authenticate"] == "Bearer"
        assert json.loads(answer)["error"]["code"] == "invalid_api_key"
        ok = exchange(port, b"GET /echo HTTP/1.1\r\nAuthorization: Bearer k\r\n\r\n")
        assert ok[0] == 200


def test_a_stream_is_sent_chunked_and_its_source_let_go_once_sent() -> None:
    with serving() as (port, app, _):
        status, headers, body = exchange(port, b"GET /stream?done HTTP/1.1\r\n\r\n")
        assert status == 200 and headers["content-type"] == "text/event-stream"
        assert body == b"onetwo"
        wait_for(lambda: app.closed == ["done"])


def test_a_client_leaving_mid_stream_cancels_its_handler_and_lets_go_of_the_source() -> None:
    with serving() as (port, app, server):
        s = connect(port)
        s.sendall(b"GET /stream?hang HTTP/1.1\r\n\r\n")
        assert app.streaming.wait(10)
        s.close()
        assert app.cancelled.wait(10)
        wait_for(lambda: app.closed == ["hang"] and not server.open)


def test_an_idle_connection_is_closed_at_the_header_deadline_and_a_slow_body_is_a_408() -> None:
    limits = ConnectionLimits(header_timeout=0.3, body_timeout=0.3)
    with serving(limits) as (port, _, server):
        with connect(port) as idle:
            idle.sendall(b"GET /echo HTTP/1.1\r\n")  # a head that never ends
            assert closed_by_server(idle)
        with connect(port) as slow:
            slow.sendall(b"POST /echo HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc")
            status, _, answer = read_response(slow)
            assert status == 408 and b"did not arrive within 0.3 s" in answer
        with connect(port) as kept:  # between requests the deadline starts again
            buf = bytearray()
            for _ in range(3):
                kept.sendall(b"GET /echo HTTP/1.1\r\n\r\n")
                assert read_response(kept, buf)[0] == 200
            assert closed_by_server(kept)
        wait_for(lambda: not server.open)


def test_a_body_deadline_shorter_than_the_head_deadline_is_kept() -> None:
    """The connection's timer was set for the head (30 s); the body's 0.3 s still holds (the
    client's socket gives up after 10 s)."""
    limits = ConnectionLimits(header_timeout=30, body_timeout=0.3)
    with serving(limits) as (port, _, _), connect(port) as slow:
        slow.sendall(b"POST /echo HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc")
        assert read_response(slow)[0] == 408


def test_a_header_value_with_a_line_break_is_not_passed_on() -> None:
    with serving() as (port, _, _):
        status, headers, _ = exchange(port, b"GET /split HTTP/1.1\r\n\r\n")
        assert status == 200 and headers["x-ok"] == "yes"
        assert "x-evil" not in headers and "set-cookie" not in headers


def test_connections_over_the_cap_get_a_503_and_are_closed() -> None:
    with serving(ConnectionLimits(max_connections=2)) as (port, _, server):
        kept = [connect(port), connect(port)]
        wait_for(lambda: len(server.open) == 2)
        with connect(port) as third:
            status, headers, answer = read_response(third)
            assert status == 503 and headers["retry-after"] == "1" and b"retry" in answer
        for s in kept:  # the two still work
            s.sendall(b"GET /echo HTTP/1.1\r\n\r\n")
            assert read_response(s)[0] == 200
            s.close()
        wait_for(lambda: not server.open)
