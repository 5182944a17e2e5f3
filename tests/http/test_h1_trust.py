"""Issue 34 ("Trust boundaries, round two") against `http/h1_server.py` over real loopback
sockets: bytes a strict reader refuses without a traceback (finding 12), refusals decided on
the head before any body byte is read (finding 3), HTTP/1.0 answers without chunks (finding 15)."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvconnect.api.protocol import MAX_BODY_BYTES
from kvconnect.http.auth import BearerAuth

from ..helpers import free_port, wait_for
from ..serving import RouterProcess, Serve
from .test_h1_server import closed_by_server, connect, exchange, read_response, serving


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"GET /\xff HTTP/1.1\r\nHost: x\r\n\r\n", b"request target"),
        (b"GET /echo?q=\xc3\xa9 HTTP/1.1\r\n\r\n", b"request target"),
        (b"GET /ec\x01ho HTTP/1.1\r\n\r\n", b"request target"),
        (b"G\xffT /echo HTTP/1.1\r\n\r\n", b"request line"),
        (b"G\x01T /echo HTTP/1.1\r\n\r\n", b"request line"),
        (b"GET /echo HTTP/1.1\r\nX-\xff: 1\r\n\r\n", b"header token"),
        (b"GET /echo HTTP/1.1\r\nX-\x01: 1\r\n\r\n", b"header token"),
        (b"GET /echo HTTP/1.1\r\nX: a\x00b\r\n\r\n", b"header value char"),
    ],
)
def test_a_non_ascii_or_control_byte_in_a_head_is_a_400_without_a_traceback(
    raw: bytes, says: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """Finding 12: `GET /\\xff` raised in the protocol callback: no answer, a traceback per
    request at ERROR."""
    with caplog.at_level(logging.INFO), serving() as (port, _, _):
        with connect(port) as s:
            s.sendall(raw)
            status, _, answer = read_response(s)
            assert status == 400 and says in answer, answer
            assert closed_by_server(s)
        assert exchange(port, b"GET /echo HTTP/1.1\r\n\r\n")[0] == 200  # it serves on
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors


def test_a_latin_1_header_value_is_taken_as_obs_text() -> None:
    """Bytes 0x80-0xff in a value are obs-text (RFC 9110 5.5): taken, as before."""
    with serving() as (port, _, _):
        assert exchange(port, b"GET /echo HTTP/1.1\r\nX: caf\xe9\r\n\r\n")[0] == 200


def read_until_closed(s: socket.socket) -> bytes:
    """All the server sends until it closes its side (`s`'s timeout if it does not)."""
    data = b""
    while chunk := s.recv(1 << 16):
        data += chunk
    return data


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"POST /echo HTTP/1.1\r\nContent-Length: %d\r\n" % MAX_BODY_BYTES, 401),
        (b"POST /echo HTTP/1.1\r\nAuthorization: Bearer no\r\nTransfer-Encoding: chunked\r\n", 401),
        (b"POST /nothing HTTP/1.1\r\nAuthorization: Bearer k\r\nContent-Length: 9\r\n", 404),
        (b"PUT /echo HTTP/1.1\r\nAuthorization: Bearer k\r\nContent-Length: 9\r\n", 405),
    ],
)
def test_a_refusal_on_the_head_is_answered_before_the_body_without_100_continue(
    head: bytes, status: int
) -> None:
    """Finding 3: the server read and decoded up to 4 MiB (for up to the body deadline) and
    said `100 Continue` before it checked the key, the path and the method."""
    with serving(auth=BearerAuth("k")) as (port, _, server):
        with connect(port) as s:
            s.settimeout(5)  # the body deadline is 30 s: an answer within 5 s came at the head
            s.sendall(head + b"Expect: 100-continue\r\n\r\n")
            answer = read_until_closed(s)
            assert answer.startswith(b"HTTP/1.1 %d " % status), answer
            assert b"100 Continue" not in answer and b"Connection: close\r\n" in answer
        wait_for(lambda: not server.open)


def test_a_refused_request_whose_body_came_with_its_head_keeps_its_connection() -> None:
    """A small body already read with the head is dropped and the connection serves on."""
    with serving(auth=BearerAuth("k")) as (port, _, _), connect(port) as s:
        buf = bytearray()
        s.sendall(b"POST /echo HTTP/1.1\r\nContent-Length: 2\r\n\r\nno")
        assert read_response(s, buf)[0] == 401
        s.sendall(b"POST /echo HTTP/1.1\r\nAuthorization: Bearer k\r\nContent-Length: 2\r\n\r\nok")
        assert json.loads(read_response(s, buf)[2])["body"] == "ok"


def test_an_authorized_request_still_gets_100_continue_and_its_body_read() -> None:
    with serving(auth=BearerAuth("k")) as (port, _, _), connect(port) as s:
        s.sendall(
            b"POST /echo HTTP/1.1\r\nAuthorization: Bearer k\r\nExpect: 100-continue\r\n"
            b"Content-Length: 2\r\n\r\n"
        )
        assert s.recv(64).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        s.sendall(b"ok")
        assert json.loads(read_response(s)[2])["body"] == "ok"


@pytest.mark.parametrize("connection", [b"", b"Connection: keep-alive\r\n"])
def test_an_http_1_0_client_gets_no_chunks_a_stream_runs_to_the_close(connection: bytes) -> None:
    """Finding 15: an HTTP/1.0 keep-alive client got `Transfer-Encoding: chunked`, which
    HTTP/1.0 does not have (it would read the chunk sizes as the body)."""
    with serving() as (port, _, server):
        with connect(port) as s:
            s.sendall(b"GET /stream HTTP/1.0\r\n%s\r\n" % connection)
            head, _, body = read_until_closed(s).partition(b"\r\n\r\n")
            assert b"Transfer-Encoding" not in head and b"Connection: close\r\n" in head + b"\r\n"
            assert head.startswith(b"HTTP/1.1 200 ") and body == b"onetwo"
        with connect(port) as s:
            s.sendall(b"HEAD /stream HTTP/1.0\r\n%s\r\n" % connection)
            assert b"Transfer-Encoding" not in read_until_closed(s)
        with connect(port) as s:
            s.sendall(b"POST /echo HTTP/1.0\r\n%sContent-Length: 2\r\n\r\nok" % connection)
            status, headers, answer = read_response(s)
            assert status == 200 and "transfer-encoding" not in headers
            assert json.loads(answer)["body"] == "ok"
        wait_for(lambda: not server.open)


def test_the_router_process_refuses_keyless_heads_and_stray_bytes_at_once(tmp_path: Path) -> None:
    """The three findings on the real `kvconnect router` (its instance never started: no
    request here reaches one)."""
    router = RouterProcess(tmp_path, [Serve(tmp_path)], "--api-key", "k")
    router.start()
    try:
        with socket.create_connection(("127.0.0.1", router.port), timeout=5) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nExpect: 100-continue\r\n"
                b"Content-Length: %d\r\n\r\n" % MAX_BODY_BYTES
            )
            answer = read_until_closed(s)  # at once, not after the 30 s body deadline
            assert answer.startswith(b"HTTP/1.1 401 ") and b"100 Continue" not in answer
        for _ in range(20):
            assert exchange(router.port, b"GET /\xff HTTP/1.1\r\nHost: x\r\n\r\n")[0] == 400
        with socket.create_connection(("127.0.0.1", router.port), timeout=5) as s:
            s.sendall(b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            status, headers, body = read_response(s)
            assert status == 503 and "transfer-encoding" not in headers
            assert json.loads(body)["status"] == "error"
        assert router.alive()
    finally:
        assert router.stop() == 0, router.logs()
    assert "Traceback" not in router.logs() and " ERROR " not in router.logs(), router.logs()


class StreamingInstance:
    """An instance of this test: /health 200; a POST is answered with an endless chunked
    event stream, written as fast as the router takes it (until it closes)."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                event = b"data: " + b"x" * 16_000 + b"\n\n"
                with contextlib.suppress(OSError):
                    while True:
                        self.wfile.write(b"%x\r\n%b\r\n" % (len(event), event))
                self.close_connection = True

            def log_message(self, *args: object) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.instance = (
            f"http://127.0.0.1:{self.http.server_address[1]},tcp://127.0.0.1:{free_port()}"
        )

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def test_clients_that_never_read_their_streams_are_cut_at_the_write_deadline(
    tmp_path: Path,
) -> None:
    """Finding 4: no deadline while the router wrote an answer. Clients that asked for a
    stream and never read held every connection slot: new clients got 503 as long as they
    stayed (75 s in the review; on the code before, for ever). Now an answer the client takes
    none of for --write-timeout ends its connection and frees the slot."""
    instance = StreamingInstance()
    router = RouterProcess(
        tmp_path,
        [],
        "--instance",
        instance.instance,
        "--max-connections",
        "4",
        "--write-timeout",
        "1",
        "--access-log",
    )
    router.start()
    stalled = []
    try:
        body = json.dumps({"model": "tiny", "prompt": "hi", "stream": True}).encode()
        request = b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body)
        request += body
        for _ in range(4):
            s = socket.create_connection(("127.0.0.1", router.port), timeout=10)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(request)
            stalled.append(s)
        assert exchange(router.port, b"GET /health HTTP/1.1\r\n\r\n")[0] == 503  # all slots held

        def served() -> bool:
            try:
                return exchange(router.port, b"GET /health HTTP/1.1\r\n\r\n")[0] == 200
            except OSError:
                return False

        wait_for(served, timeout=30, interval=0.1, what="no slot freed from the stalled clients")
        wait_for(
            lambda: router.logs().count("write stalled") == 4,
            timeout=30,
            interval=0.1,
            what="the four stalled clients cut",
        )
        assert router.alive()
    finally:
        for s in stalled:
            s.close()
        assert router.stop() == 0, router.logs()
        instance.stop()
    logs = router.logs()
    assert logs.count("write stalled") == 4 and "Traceback" not in logs, logs


def test_a_stream_cut_at_its_source_never_looks_complete(caplog: pytest.LogCaptureFixture) -> None:
    """Finding 5, the server's half (the relay's is tested on the router process): a
    stream whose source raises ends without the last chunk, and one that runs to the close
    (HTTP/1.0) is reset: on the code before it ended with a FIN, which is how a whole
    answer ends, and each cut logged a traceback at ERROR; now one warning."""
    with caplog.at_level(logging.INFO), serving() as (port, _, _):
        with connect(port) as s:
            s.sendall(b"GET /cut HTTP/1.1\r\n\r\n")
            answer = read_until_closed(s)
            assert answer.endswith(b"\r\n\r\n3\r\none\r\n"), answer  # no last chunk
        with connect(port) as s, pytest.raises(ConnectionResetError):
            s.sendall(b"GET /cut HTTP/1.0\r\n\r\n")
            read_until_closed(s)
    cut = [r for r in caplog.records if "the answer was cut" in r.getMessage()]
    assert len(cut) == 2 and not any(r.exc_info for r in caplog.records)


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"Transfer-Encoding: chunked\r\n\r\n2;a\nb\r\nok\r\n0\r\n\r\n", b"chunk extension"),
        (b"Transfer-Encoding: chunked\r\n\r\n2;a\rb\r\nok\r\n0\r\n\r\n", b"chunk"),
        (b"Transfer-Encoding: chunked\r\n\r\n2 \r\nok\r\n0\r\n\r\n", b"chunk size"),
        (b"X: a\x01b\r\nContent-Length: 2\r\n\r\nok", b"header value char"),
        (b"X: a\x7fb\r\nContent-Length: 2\r\n\r\nok", b"header value char"),
    ],
)
def test_what_serves_parser_rejects_the_router_rejects(raw: bytes, says: bytes) -> None:
    """Finding 11: the router took a bare LF or CR in a chunk extension, whitespace after a
    chunk size and control bytes in a field value, which serve's parser refuses (a request
    two parsers read differently is how smuggling starts); llhttp refuses them now."""
    with serving() as (port, _, _), connect(port) as s:
        s.sendall(b"POST /echo HTTP/1.1\r\n" + raw)
        status, _, answer = read_response(s)
        assert status == 400 and says in answer, answer
        assert closed_by_server(s)
