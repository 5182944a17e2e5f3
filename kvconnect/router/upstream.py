"""The router's client towards the instances: HTTP/1.1 over pooled keep-alive connections.

    pool = UpstreamPool()
    resp = await pool.post(url, path, body)      headers read; `Unreachable` if it never got that
    body = await resp.read()                     Content-Length or chunked, whole
    async for data in resp.iter_body(): ...      or piece by piece, as it arrives
    resp.release()                               the connection goes back (or is closed)
    await pool.close()

Why not aiohttp's client: a proxied completion through it costs ~150 us of CPU on this machine,
through this ~20 us (`bench/routers.py` measures the router's whole added latency beside
vllm-router's). It speaks only what the relay needs: one request at a time per connection, a
JSON body of known length out, a response of known length or chunked back; anything else
(an upgrade, a response without length or chunking, a header section over 64 KiB) ends that
connection. A response is read to its end before its connection is reused, so a reply can
never be mistaken for the next request's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

MAX_HEADER_BYTES = 64 << 10
"""The status line and headers of one response, at most."""
MAX_IDLE_PER_INSTANCE = 64
"""Idle keep-alive connections kept per instance; more are closed when released."""
CONNECT_TIMEOUT_S = 5.0


class Unreachable(Exception):
    """The instance failed before answering: the request may go to another one."""


class UpstreamBroken(Exception):
    """The instance failed after its answer had begun (a cut, malformed framing)."""


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        self.writer.close()


class UpstreamResponse:
    """One response: status and headers read, the body still on the connection."""

    def __init__(
        self, pool: UpstreamPool, key: str, conn: _Connection, status: int, head: dict[str, str]
    ) -> None:
        self._pool, self._key = pool, key
        self._conn: _Connection | None = conn
        self.status = status
        self.headers = head
        """Header names lowercased; a repeated header keeps its last value."""
        length = head.get("content-length")
        self.chunked = "chunked" in head.get("transfer-encoding", "").lower()
        self.content_length = None if length is None or self.chunked else int(length)
        self._keep_alive = head.get("connection", "").lower() != "close"
        self._done = False

    async def read(self) -> bytes:
        return b"".join([data async for data in self.iter_body()])

    async def iter_body(self) -> AsyncIterator[bytes]:
        """The body as it arrives; `UpstreamBroken` if the connection ends early."""
        if self._conn is None:
            raise RuntimeError("UpstreamResponse read after release()")
        reader = self._conn.reader
        try:
            if self.content_length is not None:
                left = self.content_length
                while left:
                    data = await reader.read(min(left, 1 << 16))
                    if not data:
                        raise UpstreamBroken(f"body ended {left} bytes early")
                    left -= len(data)
                    yield data
            elif self.chunked:
                async for data in _chunks(reader):
                    yield data
            else:  # neither: the body runs to the end of the connection
                self._keep_alive = False
                while data := await reader.read(1 << 16):
                    yield data
            self._done = True
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
            raise UpstreamBroken(f"malformed or cut body: {e}") from None
        except ConnectionError as e:
            raise UpstreamBroken(str(e) or type(e).__name__) from None

    def release(self) -> None:
        """Hand the connection back if the body was read whole and the instance keeps it."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._done and self._keep_alive:
            self._pool._put(self._key, conn)
        else:
            conn.close()


async def _chunks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The payloads of a chunked body, up to and including its trailer."""
    while True:
        line = await reader.readuntil(b"\r\n")
        size = int(line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailer fields, if any
                pass
            return
        data = await reader.readexactly(size + 2)
        if data[-2:] != b"\r\n":
            raise ValueError("chunk not followed by CRLF")
        yield data[:-2]


class UpstreamPool:
    """Keep-alive connections per instance, opened on demand (single event loop)."""

    def __init__(self, connect_timeout: float = CONNECT_TIMEOUT_S) -> None:
        self._connect_timeout = connect_timeout
        self._idle: defaultdict[str, list[_Connection]] = defaultdict(list)
        self._closed = False

    async def post(
        self, base_url: str, path: str, body: bytes, content_type: str = "application/json"
    ) -> UpstreamResponse:
        """POST `body`; the response with its headers read. A refused or timed-out connect is
        `Unreachable` at once; a pooled connection that the instance had closed (seen as an
        empty answer) is retried on a new one, so only a fresh connection's failure counts."""
        parts = urlsplit(base_url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        key = f"{host}:{port}"
        head = (
            f"POST {parts.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {key}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode("latin-1")
        while True:
            conn, pooled = self._take(key), True
            if conn is None:
                conn, pooled = await self._open(host, port), False
            try:
                conn.writer.write(head + body)
                status, headers = await _read_head(conn.reader)
                return UpstreamResponse(self, key, conn, status, headers)
            except (ConnectionError, asyncio.IncompleteReadError, UpstreamBroken) as e:
                conn.close()
                if not pooled:
                    raise Unreachable(str(e) or type(e).__name__) from None

    async def _open(self, host: str, port: int) -> _Connection:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, limit=MAX_HEADER_BYTES),
                self._connect_timeout,
            )
        except (OSError, TimeoutError) as e:
            raise Unreachable(str(e) or type(e).__name__) from None
        return _Connection(reader, writer)

    def _take(self, key: str) -> _Connection | None:
        idle = self._idle[key]
        while idle:
            conn = idle.pop()
            if not conn.reader.at_eof() and not conn.writer.is_closing():
                return conn
            conn.close()
        return None

    def _put(self, key: str, conn: _Connection) -> None:
        idle = self._idle[key]
        if self._closed or len(idle) >= MAX_IDLE_PER_INSTANCE:
            conn.close()
        else:
            idle.append(conn)

    async def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
                with contextlib.suppress(Exception):
                    await conn.writer.wait_closed()
        self._idle.clear()


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status and headers; `UpstreamBroken` for anything that is not HTTP/1.x."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise UpstreamBroken(f"response headers over {MAX_HEADER_BYTES} bytes") from None
    lines = raw[:-4].decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise UpstreamBroken(f"not an HTTP/1.x response: {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise UpstreamBroken(f"malformed header line {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    return int(code), headers
