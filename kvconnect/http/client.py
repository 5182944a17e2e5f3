"""The router's client towards the instances: HTTP/1.1 over pooled keep-alive connections.

    pool = UpstreamPool()
    resp = await pool.post(url, path, body)      headers read; `Unreachable` if it never got that
    body = await resp.read()                     Content-Length or chunked, whole
    async for data in resp.iter_body(): ...      or piece by piece, as it arrives
    resp.release()                               the connection goes back (or is closed)
    await pool.close()

Why not aiohttp's client: a proxied completion through it costs ~150 us of CPU on this machine,
through this ~20 us (`bench/routers.py` measures the router's whole added latency beside
vllm-router's); each connection is a `client_connection.Connection`, a protocol that parses
what the instance sends with llhttp (httptools). It speaks only what the relay needs: one
request at a time per connection, a body of known length out, an answer of known length,
chunked or running to the close back; anything llhttp refuses (and an upgrade, or a status
line and fields over 64 KiB) ends that connection. An answer is read to its end before its
connection is reused, so a reply can never be mistaken for the next request's.

Deadlines: a connect has `connect_timeout`; once a request is sent, the instance may stay
silent for at most `read_timeout` while the relay waits on it (before its head, and between
pieces of its body; not while the relay waits on its own client): then its
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

from kvconnect.http.client_connection import MAX_BUFFERED, Connection, Malformed

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


class UpstreamResponse:
    """One response: status and headers read, the body still on the connection."""

    def __init__(self, pool: UpstreamPool, key: str, conn: Connection) -> None:
        self._pool, self._key = pool, key
        self._conn: Connection | None = conn
        self.status = conn.status
        self.headers = conn.fields
        """Header names lowercased; a repeated header keeps its last value."""
        self.chunked = self.headers.get("transfer-encoding", "").lower().endswith("chunked")
        length = None if self.chunked else self.headers.get("content-length")
        self.content_length = None if length is None else int(length)  # llhttp: digits only

    async def read(self) -> bytes:
        """The whole body (of a known length: held at once, so read without pausing)."""
        conn = self._connection()
        if self.content_length is not None:
            conn.want = max(self.content_length, MAX_BUFFERED)
        try:
            return b"".join([data async for data in self.iter_body()])
        finally:
            conn.want = MAX_BUFFERED

    async def iter_body(self) -> AsyncIterator[bytes]:
        """The body as llhttp hands it over (pieces of at most one socket read, however large
        a chunk the instance announced); `UpstreamBroken` if the connection ends first or the
        framing is malformed."""
        conn = self._connection()
        try:
            while data := await conn.piece():
                yield data
        except Malformed as e:
            raise self._broken(str(e)) from None
        except ConnectionError:
            if self.content_length is not None:
                left = self.content_length - conn.received
                raise self._broken(f"body ended {left} bytes early") from None
            raise self._broken("chunked body ended before its last chunk") from None
        if conn.timed_out:  # aborted while the last piece was read: not a whole body
            raise self._broken("aborted")

    def _connection(self) -> Connection:
        if self._conn is None:
            raise RuntimeError("UpstreamResponse read after release()")
        return self._conn

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
        if conn.complete and conn.keep_alive and not conn.timed_out:
            self._pool._put(self._key, conn)
        else:
            conn.close()


class UpstreamPool:
    """Keep-alive connections per instance, opened on demand (single event loop)."""

    def __init__(
        self, connect_timeout: float = CONNECT_TIMEOUT_S, read_timeout: float = READ_TIMEOUT_S
    ) -> None:
        self._connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._idle: defaultdict[str, list[Connection]] = defaultdict(list)
        self._busy: set[Connection] = set()
        self._targets: dict[tuple[str, str, str], tuple[str, str, int, bytes]] = {}
        self._watchdog: asyncio.Task[None] | None = None
        self._closed = False

    def _target(self, method: str, base_url: str, path: str) -> tuple[str, str, int, bytes]:
        """(pool key, host, port, the request line and Host header) for a URL, made once."""
        found = self._targets.get((method, base_url, path))
        if found is None:
            parts = urlsplit(base_url)
            host, port = parts.hostname or "127.0.0.1", parts.port or 80
            key = f"{host}:{port}"
            line = f"{method} {parts.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {key}\r\n"
            line_bytes = line.encode("latin-1")
            found = self._targets[(method, base_url, path)] = (key, host, port, line_bytes)
        return found

    async def get(
        self, base_url: str, path: str, authorization: str | None = None
    ) -> UpstreamResponse:
        """GET, as `post` without a body (the health checks, /v1/models)."""
        head = self._target("GET", base_url, path)[3]
        if authorization:
            head += f"Authorization: {authorization}\r\n".encode("latin-1")
        return await self._send("GET", base_url, path, head + b"\r\n")

    async def post(
        self,
        base_url: str,
        path: str,
        body: bytes,
        content_type: str = "application/json",
        authorization: str | None = None,
        extra_headers: str = "",
    ) -> UpstreamResponse:
        """POST `body`; the response with its headers read. A refused or timed-out connect is
        `Unreachable` at once; a pooled connection that the instance had closed (seen as an
        empty answer) is retried on a new one, so only a fresh connection's failure counts.
        An instance silent for `read_timeout` is `UpstreamTimeout` (never retried: it may be
        working on it). `authorization` is sent as that header (no CR or LF in it);
        `extra_headers` are header lines as they are sent, each ending in CRLF."""
        line = self._target("POST", base_url, path)[3]
        auth = f"Authorization: {authorization}\r\n" if authorization else ""
        head = line + (
            f"{auth}{extra_headers}Content-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode("latin-1")
        return await self._send("POST", base_url, path, head + body)

    async def _send(
        self, method: str, base_url: str, path: str, request: bytes
    ) -> UpstreamResponse:
        key, host, port, _ = self._target(method, base_url, path)
        if self._watchdog is None:
            self._watchdog = asyncio.create_task(self._watch())
        while True:
            conn, pooled = self._take(key), True
            if conn is None:
                conn, pooled = await self._open(host, port), False
            self._busy.add(conn)
            try:
                conn.begin()
                conn.write(request)
                await conn.head()
                return UpstreamResponse(self, key, conn)
            except ConnectionError as e:
                self._drop(conn)
                if conn.timed_out:
                    raise UpstreamTimeout(f"no answer for {self.read_timeout:g} s") from None
                if isinstance(e, Malformed):  # on a fresh connection or not: not HTTP/1.x
                    raise Unreachable(str(e)) from None
                if not pooled:
                    raise Unreachable(str(e) or type(e).__name__) from None
            except BaseException:  # cancelled (the client left): the instance must see it
                self._drop(conn)
                raise

    def _drop(self, conn: Connection) -> None:
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
                conn.abort()

    async def _open(self, host: str, port: int) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: Connection(self.read_timeout), host, port),
                self._connect_timeout,
            )
        except (OSError, TimeoutError) as e:
            raise Unreachable(str(e) or type(e).__name__) from None
        return conn

    def _take(self, key: str) -> Connection | None:
        idle = self._idle[key]
        while idle:
            conn = idle.pop()
            if conn.reusable():
                return conn
            conn.close()
        return None

    def _put(self, key: str, conn: Connection) -> None:
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
                    await conn.wait_closed()
        self._idle.clear()
