"""The router's HTTP/1.1 server: a small one, written for the proxied request's latency.

`kvconnect router` adds its own time to every request it relays. Through aiohttp's server a
relayed completion cost ~650 us of CPU on this project's machines (py-spy: 39% in aiohttp's
request and response objects, its middleware chain and writer); here the front parses a
head with `bytes` methods, runs one task per request and writes a whole answer in one call
(`bench/routers.py` measures the router's added latency beside vllm-router's). `kvconnect
serve` stays on aiohttp: its time is the engine's.

    server = H1Server(routes, limits, auth)     routes: {path: {method: handler}}
    await server.start(host, port) ... await server.close()
    handler(request) -> Response                a whole body, or `stream` (sent chunked)

One connection, one request at a time (a pipelined one waits in the buffer):

    accepted -- more than max_connections open --> 503 with Retry-After, closed
        |
    waiting for a head -- header_timeout (from the accept, or from the end of the last
        |                  answer) --> closed
        |-- malformed head, unknown framing --> 400 (431, 505), closed
        |-- declared body over MAX_BODY_BYTES --> 413 at once, closed
        |-- no key, no route, wrong method --> 401/404/405 at once (no `100 Continue`, no
        |   body byte read); closed, unless the whole body came with the head
    waiting for the body (`Expect: 100-continue` answered) -- body_timeout --> 408, closed
        |   Content-Length or chunked; gzip/deflate decoded (at most MAX_BODY_BYTES)
    the handler runs as a task -- the client goes away --> the task is cancelled (the
        |                                                 relay closes its upstream)
    answer written (Content-Length in one write, or chunked as the stream yields, waiting
        |           while the transport's buffer is full) --> waiting for the next head
        '-- `Connection: close`, HTTP/1.0 (a stream to HTTP/1.0: not chunked, runs to the
                                          close, even with `keep-alive`) --> closed

Requests are checked on their head: bearer auth (`auth.py`; 401), then 404/405 in
OpenAI's error shape, so a client without a key never makes the server hold a body. Every
request gets one access-log line (`access_log.py`), the same as serve's; an unexpected
exception is a logged 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, cast

import msgspec

from kvconnect.api.protocol import MAX_BODY_BYTES, ApiError
from kvconnect.http.access_log import access_log, log_access
from kvconnect.http.auth import UNAUTHORIZED, UNAUTHORIZED_HEADERS, BearerAuth
from kvconnect.http.limits import BUSY_RESPONSE, ConnectionLimits

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 << 10
"""A request line and its headers, at most (431 above)."""
MAX_HEADERS = 128
LINGER_S = 2.0
LINGER_BYTES = 2 * MAX_BODY_BYTES
"""After refusing a request, what the client still sends is read and dropped (for at most
this long, this much) before the close: closing on unread bytes sends a reset, which can
discard the answer before the client reads it (nginx's lingering close)."""
_TOKEN = frozenset(b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_VISIBLE = bytes(range(33, 127))
"""The bytes a request target may hold (RFC 9112 3.2): deleting them leaves what may not."""
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


@dataclass(slots=True)
class Request:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    """Names lowercased; a repeated header's values joined with ", "."""
    body: bytes = b""
    keep_alive: bool = True
    can_chunk: bool = True
    """HTTP/1.1: an answer of unknown length may go chunked (HTTP/1.0 has no chunks)."""
    instance: str | None = None
    """The instance that answered, for the access log (set by the handler)."""


@dataclass(slots=True)
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: Mapping[str, str] = field(default_factory=dict)
    stream: AsyncIterator[bytes] | None = None
    """Sent chunked as it yields, in place of `body`."""
    on_close: Callable[[], None] | None = None
    """Called once the answer is sent, cut or abandoned (a relay lets go of its upstream)."""


Handler = Callable[[Request], Awaitable[Response]]


def json_response(data: Any, status: int = 200) -> Response:
    return Response(status, msgspec.json.encode(data))


def error_response(e: ApiError, headers: Mapping[str, str] | None = None) -> Response:
    return Response(e.status, msgspec.json.encode(e.body()), headers=headers or {})


class BadRequest(Exception):
    """The bytes are not a request this server takes: answered with `status`, then closed."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def parse_head(head: bytes) -> Request:
    """A request line and its headers (without the blank line); `BadRequest` for anything a
    strict reader would not take: no obs-fold, no space before a colon, one framing."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[0] or not _TOKEN.issuperset(parts[0]):
        raise BadRequest("malformed request line")
    method, target, version = parts
    if version not in (b"HTTP/1.1", b"HTTP/1.0"):
        if version.startswith(b"HTTP/"):
            raise BadRequest("only HTTP/1.0 and HTTP/1.1 are served", 505)
        raise BadRequest("malformed request line")
    if not target.startswith(b"/"):
        raise BadRequest("the request target must be a path (origin form)")
    if target.translate(None, _VISIBLE):  # one pass in C; non-ASCII would not decode below
        raise BadRequest("the request target holds a byte that is not visible ASCII")
    if len(lines) - 1 > MAX_HEADERS:
        raise BadRequest(f"more than {MAX_HEADERS} headers", 431)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or not _TOKEN.issuperset(name):
            raise BadRequest(f"malformed header line {line[:40]!r}")
        if b"\r" in value or b"\n" in value or b"\0" in value:
            raise BadRequest("a header value holds a control character")
        key, text = name.decode("ascii").lower(), value.strip(b" \t").decode("latin-1")
        previous = headers.get(key)
        headers[key] = text if previous is None else f"{previous}, {text}"
    path, _, query = target.decode("ascii").partition("?")
    connection = headers.get("connection", "").lower()
    http_1_1 = version == b"HTTP/1.1"
    persistent = http_1_1 or "keep-alive" in connection
    keep_alive = persistent and "close" not in connection
    return Request(
        method.decode("ascii"), path, query, headers, keep_alive=keep_alive, can_chunk=http_1_1
    )


def body_length(request: Request) -> int | None:
    """The declared body length (0 without one); None for a chunked body."""
    coding = request.headers.get("transfer-encoding")
    length = request.headers.get("content-length")
    if coding is not None:
        if length is not None:
            raise BadRequest("both Content-Length and Transfer-Encoding")
        if coding.lower() != "chunked":
            raise BadRequest(f"Transfer-Encoding {coding!r} is not supported (only chunked)", 501)
        return None
    if length is None:
        return 0
    if not length.isdigit() or not length.isascii() or len(length) > 18:
        raise BadRequest(f"Content-Length {length[:40]!r} is not a length")
    n = int(length)
    if n > MAX_BODY_BYTES:
        raise BadRequest(f"request body of {n} bytes is over the limit of {MAX_BODY_BYTES}", 413)
    return n


def decoded(request: Request, body: bytes) -> bytes:
    """The body with its Content-Encoding (gzip, deflate) undone, at most MAX_BODY_BYTES."""
    coding = request.headers.get("content-encoding", "identity").lower().strip()
    if coding == "identity" or not body:
        return body
    if coding not in ("gzip", "deflate"):
        raise BadRequest(f"Content-Encoding {coding!r} is not supported (gzip, deflate)", 415)
    # gzip's header, or deflate as zlib's stream (as the RFC) or raw (as some clients send it)
    for wbits in (31,) if coding == "gzip" else (15, -15):
        d = zlib.decompressobj(wbits)
        try:
            out = d.decompress(body, MAX_BODY_BYTES + 1)
        except zlib.error:
            continue
        if len(out) > MAX_BODY_BYTES:
            raise BadRequest(f"request body is over the limit of {MAX_BODY_BYTES} bytes", 413)
        if d.eof and not d.unused_data:
            return out
    raise BadRequest(f"the body does not decode (Content-Encoding: {coding})")


def _head(response: Response, keep_alive: bool) -> bytearray:
    """The status line and headers, without the framing headers and the blank line. Values
    may come from an instance's answer: one with a line break is not passed on (it would add
    headers of its own to the client's response)."""
    head = bytearray(b"HTTP/1.1 %d %s\r\n" % (response.status, _REASONS.get(response.status, b"")))
    for name, value in (("Content-Type", response.content_type), *response.headers.items()):
        if "\r" not in value and "\n" not in value:
            head += f"{name}: {value}\r\n".encode("latin-1", "replace")
    if not keep_alive:
        head += b"Connection: close\r\n"
    return head


def _error_bytes(status: int, message: str) -> bytes:
    body = msgspec.json.encode(ApiError(message, status=status).body())
    head = _head(Response(status), keep_alive=False)
    return bytes(head + b"Content-Length: %d\r\n\r\n" % len(body)) + body


class _Connection(asyncio.Protocol):
    """One client connection: its buffer, its deadline, at most one request running."""

    def __init__(self, server: H1Server) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()  # once: each lookup is a getpid() syscall
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.scanned = 0
        """Bytes of the buffer already searched for the end of a head."""
        self.request: Request | None = None
        """A request whose head has arrived and whose body is still coming."""
        self.answer: Handler | Response | None = None
        """What answers `request`: its handler, or the refusal its head earned (401, 404, 405)."""
        self.length: int | None = 0
        self.chunks: list[bytes] = []
        self.chunked_size = 0
        self.chunk_left = -1
        """Bytes (with their CRLF) left of the chunk being read; -1 at a size line."""
        self.task: asyncio.Task[None] | None = None
        self.deadline = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.reading_paused = False
        self.writable: asyncio.Future[None] | None = None
        self.closed = False
        self.lingering = -1
        """Bytes dropped since a refusal (-1: none)."""

    # -- asyncio.Protocol -----------------------------------------------------------------------

    def connection_made(self, base: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, base)  # uvloop's are no asyncio.Transport subclass
        if len(self.server.open) >= self.server.limits.max_connections:
            self.closed = True
            transport.write(BUSY_RESPONSE)
            transport.close()
            return
        self.transport = transport
        self.server.open.add(self)
        self._arm(self.server.limits.header_timeout)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        if self.lingering >= 0:
            self.lingering += len(data)
            if self.lingering > LINGER_BYTES:
                self._close()
            return
        self.buffer += data
        if self.task is None:
            self._next()
        elif len(self.buffer) > MAX_HEAD_BYTES and self.transport is not None:
            self.reading_paused = True  # a client pipelining more than a head ahead waits
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        return False  # the transport closes itself: a running request is cancelled

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.open.discard(self)
        if self.timer is not None:
            self.timer.cancel()
        if self.task is not None:
            self.task.cancel()
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)

    def pause_writing(self) -> None:
        self.writable = self.loop.create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        self.writable = None

    # -- reading a request ----------------------------------------------------------------------

    def _next(self) -> None:
        """Take the next request from the buffer when it is all there, and start it."""
        try:
            if self.request is None:
                while self.buffer.startswith(b"\r\n"):  # empty lines before a request line
                    del self.buffer[:2]
                # A head arriving byte by byte is searched once, not once per byte.
                end = self.buffer.find(b"\r\n\r\n", self.scanned)
                if end > MAX_HEAD_BYTES or (end < 0 and len(self.buffer) > MAX_HEAD_BYTES):
                    raise BadRequest(f"request head over {MAX_HEAD_BYTES} bytes", 431)
                if end < 0:
                    self.scanned = max(0, len(self.buffer) - 3)
                    return
                self.scanned = 0
                request = parse_head(bytes(self.buffer[:end]))
                del self.buffer[: end + 4]
                self.length = body_length(request)
                self.answer = self.server.admit(request)
                complete = self.length is not None and len(self.buffer) >= self.length
                if not complete:
                    if isinstance(self.answer, Response):
                        self._refuse_unread(request, self.answer)
                        return
                    if request.headers.get("expect", "").lower() == "100-continue":
                        self._write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    self._arm(self.server.limits.body_timeout)
                self.request = request
            body = self._body()
            if body is None:
                return
            request, self.request = self.request, None
            answer = self.answer
            assert answer is not None  # set with `request`
            if not isinstance(answer, Response):  # a refused body is dropped undecoded
                request.body = decoded(request, body)
        except BadRequest as e:
            self._refuse(e.status, str(e))
            return
        self._disarm()
        self.task = self.loop.create_task(self._run(request, answer))

    def _body(self) -> bytes | None:
        """The whole body once it has arrived, else None."""
        if self.length is not None:
            if len(self.buffer) < self.length:
                return None
            body = bytes(self.buffer[: self.length])
            del self.buffer[: self.length]
            return body
        while True:  # chunked: size line, data, CRLF; a zero size, trailers, a blank line
            if self.chunk_left < 0:
                end = self.buffer.find(b"\r\n")
                if end < 0:
                    if len(self.buffer) > 1024:
                        raise BadRequest("a chunk size line over 1024 bytes")
                    return None
                size_field = bytes(self.buffer[:end]).split(b";", 1)[0].strip()
                if not size_field or not _HEX.issuperset(size_field) or len(size_field) > 8:
                    raise BadRequest("malformed chunk size")
                size = int(size_field, 16)
                self.chunked_size += size
                if self.chunked_size > MAX_BODY_BYTES:
                    raise BadRequest(f"request body over the limit of {MAX_BODY_BYTES} bytes", 413)
                if size == 0:  # the last chunk: trailers (ignored) up to a blank line
                    rest = end + 2
                    if self.buffer[rest : rest + 2] == b"\r\n":
                        stop = rest + 2
                    elif (found := self.buffer.find(b"\r\n\r\n", rest)) >= 0:
                        stop = found + 4
                    elif len(self.buffer) > MAX_HEAD_BYTES:
                        raise BadRequest("trailers over the head's limit", 431)
                    else:
                        return None
                    del self.buffer[:stop]
                    body, self.chunks, self.chunked_size = b"".join(self.chunks), [], 0
                    return body
                del self.buffer[: end + 2]
                self.chunk_left = size + 2
            if len(self.buffer) < self.chunk_left:
                return None
            if self.buffer[self.chunk_left - 2 : self.chunk_left] != b"\r\n":
                raise BadRequest("a chunk does not end where its size says")
            self.chunks.append(bytes(self.buffer[: self.chunk_left - 2]))
            del self.buffer[: self.chunk_left]
            self.chunk_left = -1

    def _refuse(self, status: int, message: str) -> None:
        """Answer a request that could not be read, and close (its bytes cannot be trusted to
        end where a next request would begin)."""
        access_log.info("- - %d refused: %s", status, message)
        self._write(_error_bytes(status, message))
        self._linger()

    def _refuse_unread(self, request: Request, refusal: Response) -> None:
        """Answer a request refused on its head (401, 404, 405) whose body has not all come:
        none of it is read, so a client without a key makes the server hold nothing (no
        `100 Continue` either); the connection closes after the answer, as after any
        refusal. A body that came with its head is dropped and the connection serves on."""
        log_access(request.method, request.path, refusal.status, time.monotonic(), None)
        head = _head(refusal, keep_alive=False) + b"Content-Length: %d\r\n\r\n" % len(refusal.body)
        self._write(bytes(head) + refusal.body)
        self._linger()

    def _linger(self) -> None:
        """Close after an answer to bytes left unread: what still comes is read and dropped
        first (`LINGER_S`, `LINGER_BYTES`)."""
        self._disarm()
        self.buffer.clear()
        self.lingering = 0
        if self.transport is not None and self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self._close)

    # -- deadlines -----------------------------------------------------------------------------

    def _arm(self, seconds: float) -> None:
        """A deadline `seconds` from now. A timer already set (for an earlier deadline) stays
        and is moved on when it fires: keep-alive requests in a row cost a time stamp each."""
        self.deadline = self.loop.time() + seconds
        if self.timer is not None and self.timer.when() > self.deadline:
            self.timer.cancel()  # set for a later deadline (a body's may be the shorter)
            self.timer = None
        if self.timer is None:
            self.timer = self.loop.call_at(self.deadline, self._expired)

    def _disarm(self) -> None:
        self.deadline = 0.0  # a timer that fires finds none and lets go

    def _expired(self) -> None:
        self.timer = None
        if self.closed or self.deadline == 0.0 or self.transport is None:
            return
        if self.loop.time() < self.deadline:
            self.timer = self.loop.call_at(self.deadline, self._expired)
        elif self.transport.get_write_buffer_size():
            self._arm(self.server.limits.header_timeout)  # an answer is still going out
        elif self.request is not None:
            timeout = self.server.limits.body_timeout
            self._refuse(408, f"the request body did not arrive within {timeout:g} s")
        else:
            self._close()

    # -- running it ----------------------------------------------------------------------------

    async def _run(self, request: Request, answer: Handler | Response) -> None:
        start = time.monotonic()
        status = 500
        response: Response | None = None
        try:
            if isinstance(answer, Response):
                response = answer
            else:
                response = await self.server.respond(request, answer)
            status = response.status
            await self._send(request, response)
        except asyncio.CancelledError:
            status = 499  # the client went away first (nginx's code for it)
            raise
        except Exception:  # an answer broken off: where the next one would begin is unknown
            logger.exception("%s %s: the answer failed", request.method, request.path)
            self._close()
            return
        finally:
            if response is not None and response.on_close is not None:
                response.on_close()
            if access_log.isEnabledFor(logging.INFO):
                log_access(request.method, request.path, status, start, request.instance)
        self.task = None
        if not request.keep_alive:
            self._close()
            return
        self._arm(self.server.limits.header_timeout)
        if self.reading_paused and self.transport is not None:
            self.reading_paused = False
            self.transport.resume_reading()
        if self.buffer:
            self._next()

    async def _send(self, request: Request, response: Response) -> None:
        head_only = request.method == "HEAD"
        if response.stream is None:
            head = _head(response, request.keep_alive)
            head += b"Content-Length: %d\r\n\r\n" % len(response.body)
            self._write(bytes(head) if head_only else bytes(head) + response.body)
            return
        # HTTP/1.0 knows no chunks (nor does a connection about to close need them): the
        # body runs to the close, and the connection closes after it (`_run`).
        chunked = request.keep_alive and request.can_chunk
        request.keep_alive = chunked
        head = _head(response, chunked)
        head += b"Transfer-Encoding: chunked\r\n\r\n" if chunked else b"\r\n"
        if head_only:
            self._write(bytes(head))
            return
        pending = bytes(head)
        async for data in response.stream:
            if not data:
                continue
            framed = b"%x\r\n%b\r\n" % (len(data), data) if chunked else data
            self._write(pending + framed)  # the head goes with the first piece: one write
            pending = b""
            if self.writable is not None:
                await self.writable
        self._write(pending + (b"0\r\n\r\n" if chunked else b""))

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def _close(self) -> None:
        self._disarm()
        if self.transport is not None and not self.closed:
            self.transport.close()


class H1Server:
    """Routes served on one listening socket through `_Connection`s."""

    def __init__(
        self,
        routes: Mapping[str, Mapping[str, Handler]],
        limits: ConnectionLimits,
        auth: BearerAuth | None = None,
    ) -> None:
        self.routes = routes
        self.limits = limits
        self.auth = auth if auth is not None and auth.enabled else None
        self.open: set[_Connection] = set()
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port, backlog=512)

    def admit(self, request: Request) -> Handler | Response:
        """The request's handler, or the answer refusing it: auth (401), route (404), method
        (405), decided on the head, before any byte of a body is read or decoded."""
        if self.auth is not None and not self.auth.allows(
            request.path, request.headers.get("authorization")
        ):
            return error_response(UNAUTHORIZED, UNAUTHORIZED_HEADERS)
        methods = self.routes.get(request.path)
        if methods is None:
            return error_response(ApiError(f"no route for {request.path}", status=404))
        handler = methods.get("GET" if request.method == "HEAD" else request.method)
        if handler is None:
            allowed = ", ".join(sorted(methods))
            error = ApiError(f"{request.method} is not allowed on {request.path}", status=405)
            return error_response(error, {"Allow": allowed})
        return handler

    async def respond(self, request: Request, handler: Handler) -> Response:
        """The handler's answer; never raises but on cancellation."""
        try:
            return await handler(request)
        except ApiError as e:
            return error_response(e)
        except Exception:
            logger.exception("%s %s failed", request.method, request.path)
            error = ApiError("internal error", status=500, type_="internal_error")
            return error_response(error)

    async def close(self) -> None:
        """Stop listening, close every connection (running requests are cancelled)."""
        if self._server is not None:
            self._server.close()
        tasks = [c.task for c in self.open if c.task is not None]
        for conn in list(self.open):
            if conn.transport is not None:
                conn.transport.abort()
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)


__all__ = ["H1Server", "Request", "Response", "error_response", "json_response"]
