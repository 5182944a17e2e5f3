"""The router's HTTP/1.1 server: a small one, written for the proxied request's latency.

`kvconnect router` adds its own time to every request it relays. Through aiohttp's server a
relayed completion cost ~650 us of CPU on this project's machines (py-spy: 39% in aiohttp's
request and response objects, its middleware chain and writer); here an asyncio protocol
feeds llhttp (Node's parser, through `httptools`, as uvicorn does: strict RFC 9112 framing,
fuzzed for years), runs one task per request and writes a whole answer in one call
(`bench/routers.py` measures the router's added latency beside vllm-router's). What llhttp
leaves to a server is `_check_head`: the version, the target's form, the framings taken,
the sizes. `kvconnect serve` stays on aiohttp: its time is the engine's.

    server = H1Server(routes, limits, auth)     routes: {path: {method: handler}}
    await server.start(host, port) ... await server.close()
    handler(request) -> Response                a whole body, or `stream` (sent chunked)

One connection, one request running at a time (one pipelined behind it is read, then
reading pauses):

    accepted -- more than max_connections open --> 503 with Retry-After, closed
        |
    waiting for a head -- header_timeout (from the accept, or from the end of the last
        |                  answer) --> closed
        |-- malformed head, unknown framing --> 400 (431, 501, 505), closed
        |-- declared body over MAX_BODY_BYTES --> 413 at once, closed
        |-- no key, no route, wrong method --> 401/404/405 at once (no `100 Continue`, no
        |   body byte kept); closed, unless the whole body came with the head
    waiting for the body (`Expect: 100-continue` answered) -- body_timeout --> 408, closed
        |   Content-Length or chunked; gzip/deflate decoded (at most MAX_BODY_BYTES)
    the handler runs as a task -- the client goes away --> the task is cancelled (the
        |                                                 relay closes its upstream)
    answer written (Content-Length in one write, or chunked as the stream yields, waiting
        |           while the transport's buffer is full) --> waiting for the next head
        |-- the client takes none of it for write_timeout --> aborted (the relay ends)
        |-- the stream's source fails --> closed without the last chunk (reset when the
        |                                 answer runs to the close): never looks whole
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
import socket
import struct
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, cast

import httptools
import msgspec

from kvconnect.api.protocol import MAX_BODY_BYTES, ApiError
from kvconnect.http.access_log import access_log, log_access
from kvconnect.http.auth import UNAUTHORIZED, UNAUTHORIZED_HEADERS, BearerAuth
from kvconnect.http.content_encoding import EncodingError, decode
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


def _check_head(version: str, target: bytes, headers: dict[str, str]) -> int | None:
    """What llhttp leaves to the server: the version, the target's form, the framing this
    server takes and the declared size. Returns the declared body length (0 without one),
    None for a chunked body; `BadRequest` otherwise."""
    if version not in ("1.1", "1.0"):
        if version == "0.9":  # a request line without a version
            raise BadRequest("malformed request line: no HTTP version")
        raise BadRequest("only HTTP/1.0 and HTTP/1.1 are served", 505)
    if not target.startswith(b"/"):
        raise BadRequest("the request target must be a path (origin form)")
    if target.translate(None, _VISIBLE):  # llhttp lets a fragment's bytes through
        raise BadRequest("the request target holds a byte that is not visible ASCII")
    coding = headers.get("transfer-encoding")
    if coding is not None:
        if coding.lower() != "chunked":
            raise BadRequest(f"Transfer-Encoding {coding!r} is not supported (only chunked)", 501)
        return None
    length = headers.get("content-length")
    n = 0 if length is None else int(length)  # digits only: llhttp checked it
    if n > MAX_BODY_BYTES:
        raise BadRequest(f"request body of {n} bytes is over the limit of {MAX_BODY_BYTES}", 413)
    return n


def decoded(request: Request, body: bytes) -> bytes:
    """The body with its Content-Encoding (gzip, deflate) undone, at most MAX_BODY_BYTES
    (`content_encoding.py`, serve's rule too)."""
    try:
        return decode(request.headers.get("content-encoding"), body)
    except EncodingError as e:
        raise BadRequest(str(e), e.status) from None


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


class _StreamCut(Exception):
    """A streamed answer's source failed after its head was sent (an instance cut its
    answer): the client's connection must end without the answer looking whole."""


class _Connection(asyncio.Protocol):
    """One client connection: llhttp's parser fed as bytes arrive (its callbacks, `on_*`,
    build each request), the requests it completed queued in order, at most one running."""

    def __init__(self, server: H1Server) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()  # once: each lookup is a getpid() syscall
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = bytearray()
        self.fields: list[tuple[bytes, bytes]] = []
        self.in_head = False
        self.began_here = False
        """The message began in the bytes being fed now (they are not all its head's)."""
        self.head_bytes = 0
        """The head's bytes: its fields as parsed, and whole arrivals while it is unfinished."""
        self.request: Request | None = None
        """A request whose head has been parsed and whose body is still coming."""
        self.answer: Handler | Response | None = None
        """What answers `request`: its handler, or the refusal its head earned (401, 404, 405)."""
        self.body: list[bytes] = []
        self.body_size = 0
        self.waiting_body = False
        """`request`'s body deadline is armed (and `100 Continue` sent if it asked)."""
        self.queue: deque[tuple[Request, Handler | Response, bool] | BadRequest] = deque()
        """Complete requests (with their answer, and whether their body went unread), or the
        refusal that ends the connection, in the order they came."""
        self.stopped = False
        """Nothing more is parsed: what was queued ends the connection."""
        self.task: asyncio.Task[None] | None = None
        self.deadline = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.unsent = 0
        """Bytes of an answer the client had not taken at the last deadline (write progress)."""
        self.reading_paused = False
        self.writable: asyncio.Future[None] | None = None
        self.write_timer: asyncio.TimerHandle | None = None
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
        if self.stopped:
            return  # after a request that ends the connection: dropped
        self.began_here = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # served as plain HTTP; what follows is not
            self._stop(None)
        except httptools.HttpParserCallbackError as e:
            if not isinstance(e.__context__, BadRequest):
                logger.error("reading a request failed", exc_info=e.__context__)
                self._stop(BadRequest("internal error", 500))
            else:
                self._stop(e.__context__)
        except httptools.HttpParserInvalidMethodError as e:
            self._stop(BadRequest(f"malformed request line: {e}"))
        except httptools.HttpParserInvalidURLError as e:
            self._stop(BadRequest(f"malformed request target: {e}"))
        except httptools.HttpParserError as e:
            self._stop(BadRequest(f"malformed request: {e}"))
        else:
            if self.in_head and not self.began_here:
                self.head_bytes += len(data)
                if self.head_bytes > MAX_HEAD_BYTES:
                    self._stop(BadRequest(f"request head over {MAX_HEAD_BYTES} bytes", 431))
            elif self.request is not None and isinstance(self.answer, Response):
                self.stopped = True  # refused on its head with its body still coming: unread
                self.queue.append((self.request, self.answer, True))
        self._pump()

    def eof_received(self) -> bool:
        return False  # the transport closes itself: a running request is cancelled

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.open.discard(self)
        for timer in (self.timer, self.write_timer):
            if timer is not None:
                timer.cancel()
        if self.task is not None:
            self.task.cancel()
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)

    def pause_writing(self) -> None:
        self.writable = self.loop.create_future()
        self.write_timer = self.loop.call_later(
            self.server.limits.write_timeout, self._write_stalled
        )

    def resume_writing(self) -> None:
        if self.write_timer is not None:
            self.write_timer.cancel()
            self.write_timer = None
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        self.writable = None

    # -- llhttp's callbacks: one request's head and body ------------------------------------------

    def on_message_begin(self) -> None:
        self.in_head, self.began_here, self.head_bytes = True, True, 0
        self.url.clear()
        self.fields = []

    def on_url(self, url: bytes) -> None:
        self.url += url
        self.head_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.in_head:
            return  # a trailer field of a chunked body: ignored
        self.head_bytes += len(name) + len(value) + 4
        if self.head_bytes > MAX_HEAD_BYTES:
            raise BadRequest(f"request head over {MAX_HEAD_BYTES} bytes", 431)
        if len(self.fields) == MAX_HEADERS:
            raise BadRequest(f"more than {MAX_HEADERS} headers", 431)
        self.fields.append((name, value))

    def on_headers_complete(self) -> None:
        self.in_head = False
        headers: dict[str, str] = {}
        for name, value in self.fields:  # names are tokens, values visible bytes: llhttp's
            key, text = name.decode("ascii").lower(), value.strip(b" \t").decode("latin-1")
            previous = headers.get(key)
            headers[key] = text if previous is None else f"{previous}, {text}"
        parser, target = self.parser, bytes(self.url)
        version = parser.get_http_version()
        length = _check_head(version, target, headers)
        path, _, query = target.decode("ascii").partition("?")
        method = parser.get_method().decode("ascii")
        request = Request(
            method,
            path,
            query,
            headers,
            keep_alive=parser.should_keep_alive(),
            can_chunk=version == "1.1",
        )
        self.request, self.answer = request, self.server.admit(request)
        self.body, self.body_size, self.waiting_body = [], 0, False
        if length is not None and length > 0 and isinstance(self.answer, Response):
            self.waiting_body = True  # refused: its body is dropped, nothing waits for it

    def on_body(self, body: bytes) -> None:
        if isinstance(self.answer, Response):
            return  # refused on its head: dropped undecoded
        self.body_size += len(body)
        if self.body_size > MAX_BODY_BYTES:  # chunked (a declared length was checked)
            raise BadRequest(f"request body over the limit of {MAX_BODY_BYTES} bytes", 413)
        self.body.append(body)

    def on_message_complete(self) -> None:
        request, answer = self.request, self.answer
        assert request is not None and answer is not None  # set by on_headers_complete
        self.request = self.answer = None
        if not isinstance(answer, Response):
            body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
            request.body = decoded(request, body)
        self.body = []
        self.queue.append((request, answer, False))
        if self.task is not None and not self.reading_paused and self.transport is not None:
            self.reading_paused = True  # one request waits behind the running one, no more
            self.transport.pause_reading()

    # -- taking the requests in order -----------------------------------------------------------

    def _stop(self, refusal: BadRequest | None) -> None:
        """Parse nothing more; the connection ends after what is queued (and `refusal`)."""
        self.stopped = True
        if refusal is not None:
            self.queue.append(refusal)
        elif self.queue and isinstance(last := self.queue[-1], tuple):
            last[0].keep_alive = False

    def _pump(self) -> None:
        """Start the next queued request if none runs; or wait for the body being read."""
        if self.task is not None or self.closed:
            return
        if self.queue:
            item = self.queue.popleft()
            if isinstance(item, BadRequest):
                self._refuse(item.status, str(item))
            elif item[2]:
                self._refuse_unread(item[0], cast(Response, item[1]))
            else:
                self._disarm()
                self.task = self.loop.create_task(self._run(item[0], item[1]))
        elif self.request is not None and not self.waiting_body and not self.stopped:
            self.waiting_body = True
            if self.request.headers.get("expect", "").lower() == "100-continue":
                self._write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self._arm(self.server.limits.body_timeout)

    def _refuse(self, status: int, message: str) -> None:
        """Answer a request that could not be read, and close (its bytes cannot be trusted to
        end where a next request would begin)."""
        access_log.info("- - %d refused: %s", status, message)
        self._write(_error_bytes(status, message))
        self._linger()

    def _refuse_unread(self, request: Request, refusal: Response) -> None:
        """Answer a request refused on its head (401, 404, 405) whose body has not all come:
        none of it is kept, so a client without a key makes the server hold nothing (no
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
        self.lingering = 0
        if self.reading_paused and self.transport is not None:
            self.transport.resume_reading()
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
        elif unsent := self.transport.get_write_buffer_size():
            if unsent >= self.unsent:  # an answer still going out, and none of it taken
                self._write_stalled()
                return
            self.unsent = unsent
            self._arm(self.server.limits.write_timeout)
        elif self.request is not None:
            timeout = self.server.limits.body_timeout
            self._refuse(408, f"the request body did not arrive within {timeout:g} s")
        else:
            self._close()

    def _write_stalled(self) -> None:
        """The client took none of its answer for `write_timeout`: the connection (and the
        relay behind it) ends, so that clients which never read cannot hold every slot."""
        self.write_timer = None
        if self.closed or self.transport is None:
            return
        unsent = self.transport.get_write_buffer_size()
        access_log.info(
            "- - write stalled: %d bytes unread for %g s, closed",
            unsent,
            self.server.limits.write_timeout,
        )
        self.transport.abort()

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
        except _StreamCut as e:  # never whole: no last chunk, and a close-delimited one resets
            logger.warning("%s %s: the answer was cut: %s", request.method, request.path, e)
            self._cut(request.can_chunk and request.keep_alive)
            return
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
        self.unsent = 1 << 62
        self._arm(self.server.limits.header_timeout)
        if self.reading_paused and self.transport is not None:
            self.reading_paused = False
            self.transport.resume_reading()
        self._pump()

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
        stream = response.stream
        while True:
            try:
                data = await anext(stream)
            except StopAsyncIteration:
                break
            except (asyncio.CancelledError, _StreamCut):
                raise
            except Exception as e:
                self._write(pending)  # the head, if nothing came before the cut
                raise _StreamCut(str(e) or type(e).__name__) from None
            if not data:
                continue
            framed = b"%x\r\n%b\r\n" % (len(data), data) if chunked else data
            self._write(pending + framed)  # the head goes with the first piece: one write
            pending = b""
            if self.writable is not None:
                await self.writable
        self._write(pending + (b"0\r\n\r\n" if chunked else b""))

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed and data:
            self.transport.write(data)

    def _cut(self, chunked: bool) -> None:
        """End a cut answer so that no client takes it for whole: a chunked one closes
        without its last chunk (what was sent still arrives), one that runs to the close is
        reset."""
        self._disarm()
        if self.transport is not None and not self.closed:
            if chunked:
                self.transport.close()
                return
            sock = self.transport.get_extra_info("socket")
            if sock is not None:  # a reset, not a FIN (which would end the body cleanly)
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abort()

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
