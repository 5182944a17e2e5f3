"""`http/content_encoding.py`, the one rule both servers decode request bodies by (issue 34,
finding 1): the end-to-end cases are in tests/serve/test_compressed_bodies.py (serve) and
tests/http/test_h1_server.py (the router's server)."""

from __future__ import annotations

import gzip
import tracemalloc
import zlib

import pytest

from kvconnect.http.content_encoding import PIECE_BYTES, EncodingError, decode

LIMIT = 1 << 20


def test_a_body_up_to_the_limit_decodes_and_one_byte_more_is_a_413() -> None:
    body = bytes(range(256)) * (LIMIT // 256)
    assert decode("gzip", gzip.compress(body), LIMIT) == body
    assert decode("deflate", zlib.compress(body), LIMIT) == body
    with pytest.raises(EncodingError) as e:
        decode("gzip", gzip.compress(body + b"x"), LIMIT)
    assert (
        e.value.status == 413 and str(e.value) == f"request body is over the limit of {LIMIT} bytes"
    )


def test_a_bomb_allocates_about_the_limit_and_no_more() -> None:
    bomb = gzip.compress(bytes(64 << 20), 9)  # 64 MiB in ~64 KiB
    tracemalloc.start()
    try:
        with pytest.raises(EncodingError) as e:
            decode("gzip", bomb, LIMIT)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert e.value.status == 413
    assert peak < LIMIT + LIMIT // 4 + 2 * PIECE_BYTES, peak


@pytest.mark.parametrize(
    ("coding", "body", "status"),
    [
        ("br", b"x", 415),
        ("gzip, gzip", b"x", 415),
        ("", b"x", 415),
        ("gzip", b"x", 400),
        ("gzip", gzip.compress(b"ab", mtime=0)[:-1], 400),
        ("gzip", gzip.compress(b"ab", mtime=0) * 2, 400),  # a second member
    ],
)
def test_refusals(coding: str, body: bytes, status: int) -> None:
    with pytest.raises(EncodingError) as e:
        decode(coding, body)
    assert e.value.status == status


def test_identity_no_header_and_an_empty_body_pass_as_they_are() -> None:
    assert decode(None, b"\x1f\x8b") == decode("Identity", b"\x1f\x8b") == b"\x1f\x8b"
    assert decode("br", b"") == b""
