"""Issue 34 ("Trust boundaries, round two") against `http/h1_server.py` over real loopback
sockets: bytes a strict reader refuses without a traceback (finding 12), refusals decided on
the head before any body byte is read (finding 3), HTTP/1.0 answers without chunks (finding 15)."""

from __future__ import annotations

import logging

import pytest

from .test_h1_server import closed_by_server, connect, exchange, read_response, serving


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"GET /\xff HTTP/1.1\r\nHost: x\r\n\r\n", b"request target"),
        (b"GET /echo?q=\xc3\xa9 HTTP/1.1\r\n\r\n", b"request target"),
        (b"GET /ec\x01ho HTTP/1.1\r\n\r\n", b"request target"),
        (b"G\xffT /echo HTTP/1.1\r\n\r\n", b"request line"),
        (b"G\x01T /echo HTTP/1.1\r\n\r\n", b"request line"),
        (b"GET /echo HTTP/1.1\r\nX-\xff: 1\r\n\r\n", b"malformed header"),
        (b"GET /echo HTTP/1.1\r\nX-\x01: 1\r\n\r\n", b"malformed header"),
        (b"GET /echo HTTP/1.1\r\nX: a\x00b\r\n\r\n", b"control character"),
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
