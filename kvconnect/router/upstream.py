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

Deadlines: a connect has `connect_timeout`; once a request is sent, the instance may stay
silent for at most `read_timeout` (before its head, and between pieces of its body): then its
connection is aborted and the reader gets `UpstreamTimeout`. One watchdog task per pool checks
the connections in use a few times per `read_timeout`, so a request costs a time stamp per
read, not a timer. A request whose caller is cancelled (its client went away) closes its
connection: the instance sees the disconnect and stops generating.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

MAX_HEADER_BYTES = 64 << 10
"""The status line and headers of one response, at most."""
MAX_IDLE_PER_INSTANCE = 64
"""Idle keep-alive connections kept per instance; more are closed when released."""
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 600.0
"""Silence from an instance that took a request, at most (a long non-streamed generation sends
nothing until it is done)."""


class Unreachable(Exception):
    """The instance failed before answering: the request may go to another one."""


class UpstreamBroken(Exception):
    """The instance failed after its answer had begun (a cut, malformed framing)."""


class UpstreamTimeout(UpstreamBroken):
    """The instance took the request and then said nothing for `read_timeout` seconds."""


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.deadline = 0.0
        """While a request is on it: when the instance's silence becomes a timeout."""
        self.timed_out = False

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
        conn = self._conn
        reader, timeout = conn.reader, self._pool.read_timeout
        try:
            if self.content_length is not None:
                left = self.content_length
                while left:
                    data = await reader.read(min(left, 1 << 16))
                    if not data:
                        raise UpstreamBroken(f"body ended {left} bytes early")
                    left -= len(data)
                    conn.deadline = time.monotonic() + timeout
                    yield data
            elif self.chunked:
                async for data in _chunks(reader):
                    conn.deadline = time.monotonic() + timeout
                    yield data
            else:  # neither: the body runs to the end of the connection
                self._keep_alive = False
                while data := await reader.read(1 << 16):
                    conn.deadline = time.monotonic() + timeout
                    yield data
            if conn.timed_out:  # aborted while the last piece was read: not a whole body
                raise ConnectionError("aborted")
            self._done = True
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
            raise self._broken(f"malformed or cut body: {e}") from None
        except (ConnectionError, UpstreamBroken) as e:
            raise self._broken(str(e) or type(e).__name__) from None

    def _broken(self, reason: str) -> UpstreamBroken:
        conn = self._conn
        if conn is not None and conn.timed_out:
            return UpstreamTimeout(f"no data for {self._pool.read_timeout:g} s")
        return UpstreamBroken(reason)

    def release(self) -> None:
        """Hand the connection back if the body was read whole and the instance keeps it."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        self._pool._busy.discard(conn)
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

    def __init__(
        self, connect_timeout: float = CONNECT_TIMEOUT_S, read_timeout: float = READ_TIMEOUT_S
    ) -> None:
        self._connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._idle: defaultdict[str, list[_Connection]] = defaultdict(list)
        self._busy: set[_Connection] = set()
        self._watchdog: asyncio.Task[None] | None = None
        self._closed = False

    async def post(
        self,
        base_url: str,
        path: str,
        body: bytes,
        content_type: str = "application/json",
        authorization: str | None = None,
    ) -> UpstreamResponse:
        """POST `body`; the response with its headers read. A refused or timed-out connect is
        `Unreachable` at once; a pooled connection that the instance had closed (seen as an
        empty answer) is retried on a new one, so only a fresh connection's failure counts.
        An instance silent for `read_timeout` is `UpstreamTimeout` (never retried: it may be
        working on it). `authorization` is sent as that header (no CR or LF in it)."""
        parts = urlsplit(base_url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        key = f"{host}:{port}"
        auth = f"Authorization: {authorization}\r\n" if authorization else ""
        head = (
            f"POST {parts.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {key}\r\n{auth}"
            f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode("latin-1")
        if self._watchdog is None:
            self._watchdog = asyncio.create_task(self._watch())
        while True:
            conn, pooled = self._take(key), True
            if conn is None:
                conn, pooled = await self._open(host, port), False
            conn.deadline = time.monotonic() + self.read_timeout
            self._busy.add(conn)
            try:
                conn.writer.write(head + body)
                status, headers = await _read_head(conn.reader)
                return UpstreamResponse(self, key, conn, status, headers)
            except (ConnectionError, asyncio.IncompleteReadError, UpstreamBroken) as e:
                self._drop(conn)
                if conn.timed_out:
                    raise UpstreamTimeout(f"no answer for {self.read_timeout:g} s") from None
                if not pooled:
                    raise Unreachable(str(e) or type(e).__name__) from None
            except BaseException:  # cancelled (the client left): the instance must see it
                self._drop(conn)
                raise

    def _drop(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        conn.close()

    async def _watch(self) -> None:
        """Abort the connections whose instance has been silent past their deadline."""
        period = min(self.read_timeout / 4, 1.0)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for conn in [c for c in self._busy if c.deadline < now]:
                self._busy.discard(conn)
                conn.timed_out = True
                conn.writer.transport.abort()

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
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
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
