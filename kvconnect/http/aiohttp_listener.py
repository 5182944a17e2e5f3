"""The listening socket of `kvconnect serve` (aiohttp): a connection cap and a header deadline.
The router's server (`h1_server.py`) keeps the same `ConnectionLimits` and 503 (`limits.py`)
in its own loop.

aiohttp bounds neither: 400 clients that send one byte a second keep 400 connections (and
their buffers) open for as long as they like. Each accepted connection is wrapped here before
aiohttp's own protocol sees it:

    accepted  -- more than max_connections open --> "503, Retry-After", closed at once
        |
        v
    waiting for a request head  -- header_timeout passes --> closed
        |   (from the accept, or from the end of the previous answer: an idle keep-alive
        |    connection has the same time to send its next head)
        v
    a request runs (the middleware marks it)  -- no deadline here: the body has
        |                                         `aiohttp_app.read_body`'s, the work its own
        v
    answer handed to the transport --> waiting for the next head again

aiohttp's own decompression is off (`auto_decompress=False`): request bodies reach the handler
as they were sent, and `aiohttp_app.read_body` decodes them within the body limit.

The wrapper forwards every protocol call to aiohttp's handler unchanged; it adds a timer per
connection, not per byte. Handlers run with aiohttp's `handler_cancellation`: a client that
goes away cancels its handler, whose clean-up aborts its engine requests (serve) or closes its
upstream connection (router).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import cast

from aiohttp import web
from aiohttp.typedefs import Handler
from aiohttp.web_protocol import RequestHandler

from kvconnect.http.limits import BUSY_RESPONSE, ConnectionLimits

BODY_TIMEOUT = web.AppKey("body_timeout", float)
"""The app's body deadline, for `aiohttp_app.read_body`."""


class _Guarded(asyncio.Protocol):
    """One connection: aiohttp's handler inside, the deadline and the count outside."""

    def __init__(self, inner: RequestHandler, listener: Listener) -> None:
        self._inner, self._listener = inner, listener
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0
        """When the connection, idle, must have sent a whole head (loop time)."""
        self._num_running = 0
        self._open = False

    def connection_made(self, base: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, base)  # uvloop's are no asyncio.Transport subclass
        listener = self._listener
        if len(listener.open) >= listener.limits.max_connections:
            transport.write(BUSY_RESPONSE)
            transport.close()
            return
        self._transport, self._open = transport, True
        listener.open[self._inner] = self
        self._arm()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> None:
        if self._open:
            self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._open:
            return
        self._open = False
        self._disarm()
        self._listener.open.pop(self._inner, None)
        self._inner.connection_lost(exc)

    def request_started(self) -> None:
        self._num_running += 1  # a timer that fires meanwhile finds it running and lets go

    def request_done(self) -> None:
        self._num_running -= 1
        if self._num_running == 0 and self._open:
            self._arm()

    def _arm(self) -> None:
        """The head deadline from now. A timer already set (for an earlier deadline) stays and
        is moved on when it fires: keep-alive requests in a row cost a time stamp each, not a
        timer each."""
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + self._listener.limits.header_timeout
        if self._timer is None:
            self._timer = loop.call_at(self._deadline, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        transport = self._transport
        if self._num_running or transport is None or not self._open:
            return  # request_done() arms it again
        loop = asyncio.get_running_loop()
        if loop.time() < self._deadline:  # armed again since this timer was set
            self._timer = loop.call_at(self._deadline, self._expired)
            return
        if transport.get_write_buffer_size():
            self._arm()  # an answer still on its way out: the head deadline starts after it
            return
        transport.close()


class Listener:
    """An aiohttp app served on host:port through `_Guarded` connections."""

    def __init__(self, app: web.Application, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.open: dict[RequestHandler, _Guarded] = {}
        app[BODY_TIMEOUT] = limits.body_timeout
        app.middlewares.insert(0, self._middleware)
        # auto_decompress off: aiohttp would inflate a gzip/deflate body as it arrives, on the
        # event loop, whatever its size, even for a request answered 401 or 413; bodies are
        # decoded by `aiohttp_app.read_body` (`content_encoding.py`), bounded, after the checks.
        self._runner = web.AppRunner(
            app, access_log=None, handler_cancellation=True, auto_decompress=False
        )
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        await self._runner.setup()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._protocol, host, port, backlog=512)

    def _protocol(self) -> _Guarded:
        server = self._runner.server
        assert server is not None, "Listener.start() sets the runner up first"
        return _Guarded(server(), self)

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        guard = self.open.get(request.protocol)
        if guard is None:
            return await handler(request)
        guard.request_started()
        try:
            return await handler(request)
        finally:
            guard.request_done()

    async def close(self) -> None:
        """Stop listening, then close the app (its connections, its cleanup hooks)."""
        if self._server is not None:
            self._server.close()
        with contextlib.suppress(Exception):
            await self._runner.cleanup()


__all__ = ["BODY_TIMEOUT", "Listener"]
