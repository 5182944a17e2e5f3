"""A request body's Content-Encoding, undone the same way by both servers, within a bound.

    decode(coding, body) -> bytes       coding: the Content-Encoding header's value (None: none)

    identity, no header, an empty body  the body as it came
    gzip                                one gzip member, nothing after it
    deflate                             zlib's stream (RFC 9110), else raw deflate (as some
                                        clients send it)
    anything else                       415 naming it
    data that does not decode           400
    more than `limit` bytes decoded     413 naming the limit

The body is inflated in pieces of at most PIECE_BYTES (zlib's `max_length`), and the count is
checked after each: a body that expands past the limit is refused as soon as it does, having
allocated no more than the limit. A 64 KiB gzip bomb of 64 MiB costs 4 MiB and a few
milliseconds, never its 64 MiB. The servers call it only after a request passed its checks on
the head (auth, route, method, declared size) and its compressed body arrived within the size
limit: `kvconnect serve` runs aiohttp with `auto_decompress=False` (`aiohttp_listener.py`) and
decodes in `aiohttp_app.read_body`, the router's server in `h1_server.py`.
"""

from __future__ import annotations

import zlib

from kvconnect.api.protocol import MAX_BODY_BYTES

CODINGS = ("gzip", "deflate")
PIECE_BYTES = 256 << 10
"""Bytes inflated per call into zlib at most."""


class EncodingError(Exception):
    """The body cannot be taken: answered with `status` (400, 413, 415) and this message."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def decode(coding: str | None, body: bytes, limit: int = MAX_BODY_BYTES) -> bytes:
    """`body` with its Content-Encoding `coding` undone, at most `limit` bytes."""
    name = "identity" if coding is None else coding.lower().strip()
    if name == "identity" or not body:
        return body
    if name not in CODINGS:
        raise EncodingError(f"Content-Encoding {name!r} is not supported (gzip, deflate)", 415)
    # gzip's header, or deflate as zlib's stream (as the RFC) or raw (as some clients send it)
    for wbits in (31,) if name == "gzip" else (15, -15):
        try:
            out = _inflate(body, wbits, limit)
        except zlib.error:
            continue
        if out is not None:
            return out
    raise EncodingError(f"the body does not decode (Content-Encoding: {name})")


def _inflate(body: bytes, wbits: int, limit: int) -> bytes | None:
    """The whole stream inflated; None when it ends early or has bytes after its end;
    `EncodingError` (413) as soon as more than `limit` bytes come out."""
    d = zlib.decompressobj(wbits)
    out = bytearray()
    data = body
    while True:
        piece = d.decompress(data, min(PIECE_BYTES, limit + 1 - len(out)))
        out += piece
        if len(out) > limit:
            raise EncodingError(f"request body is over the limit of {limit} bytes", 413)
        if d.eof:
            return None if d.unused_data else bytes(out)
        data = d.unconsumed_tail
        if not piece and not data:
            return None  # the input ended before the stream did


__all__ = ["CODINGS", "PIECE_BYTES", "EncodingError", "decode"]
