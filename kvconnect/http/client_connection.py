"""One keep-alive HTTP/1.1 connection to an instance, as an `asyncio.Protocol` that parses
what the instance sends with llhttp (`httptools.HttpResponseParser`, as uvicorn parses
requests); `client.py` sends requests on it and reads their answers.

llhttp owns the framing of an answer: the status line and fields (a Content-Length that is
not digits, two that differ, Content-Length beside Transfer-Encoding, a bare CR or LF, a
control byte in a field value: all refused), chunk sizes and extensions, the trailer.
Interim answers (100 Continue, 103 Early Hints) are skipped; 101 (an upgrade) is refused.
What is left here is the flow:

    conn.begin()        a request was written: the next answer is its own
    await conn.head()   (status, fields) of its final answer
    await conn.piece()  the next piece of its body as llhttp hands it over (never more than
                        one read from the socket), b"" at its end
Anything the instance sends that is not a well-framed answer to the request on the
connection sets `error` and ends the connection (`Malformed` for its reader).

Memory: body pieces wait here until the reader takes them; reading from the instance pauses
while more than `want` bytes wait (MAX_BUFFERED for a stream whose client is slower than its
instance, the whole length for a body read whole), however large a chunk the instance
announces. A status line and fields over MAX_HEADER_BYTES end the connection.

Deadline: only while a reader waits on the instance (in `_more`) does `deadline` run, which
the pool's watchdog enforces by `abort()`; while the relay waits on its own client (reading
paused), the instance is not on the clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import time
from collections import deque
from typing import cast

import httptools

MAX_HEADER_BYTES = 64 << 10
"""The status line and fields of one answer (interim ones included), at most."""
MAX_BUFFERED = 256 << 10
"""Body bytes of a streamed answer held before reading from the instance pauses (until the
relay has passed them on to its client)."""


class Closed(ConnectionError):
    """The connection ended (the instance closed it, or it was aborted) before the answer did."""


class Malformed(ConnectionError):
    """The instance sent something that is not a well-framed answer to the request."""


class Connection(asyncio.Protocol):
    """One connection and the answer on it. One reader at a time (the request on it) waits in
    `_more()`, which is when the instance's allowance of silence (`deadline`) runs."""

    def __init__(self, read_timeout: float) -> None:
        self.read_timeout = read_timeout
        self.transport: asyncio.Transport | None = None
        self.want = MAX_BUFFERED
        """Body bytes that may wait here at once: reading pauses over this."""
        self.deadline = math.inf
        """While a reader waits on the instance: when its silence becomes a timeout."""
        self.timed_out = False
        self.ended = False
        """No more data will come (the instance closed its side, or the connection is lost)."""
        self.error: str | None = None
        """Why what the instance sent was refused (the connection is then aborted)."""
        self._parser = httptools.HttpResponseParser(self)
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._lost: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # The answer on the connection.
        self._expecting = False
        self._interim = False
        self._head_bytes = 0
        self.status = 0
        self.fields: dict[str, str] = {}
        """Field names lowercased; a repeated field keeps its last value."""
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self._to_close = False
        self.received = 0
        """Body bytes of this answer so far."""
        self._pieces: deque[bytes] = deque()
        self._held = 0

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are no subclass of it
        sock = transport.get_extra_info("socket")
        if sock is not None:  # asyncio and uvloop set it as well: a request is one write
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._loop = asyncio.get_running_loop()  # once: each lookup is a getpid() syscall
        self._lost = self._loop.create_future()

    def data_received(self, data: bytes) -> None:
        if self.error is not None:
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse("an upgrade (101 Switching Protocols)")
        except httptools.HttpParserError as e:
            ours = e.__context__  # raised by a callback of ours
            self._refuse(str(ours) if isinstance(ours, Malformed) else f"malformed answer: {e}")
        else:
            if not self.head_done and self._expecting:
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEADER_BYTES:
                    self._refuse(f"status line and fields over {MAX_HEADER_BYTES} bytes")
            if self._held > self.want and not self._paused and self.transport is not None:
                self._paused = True
                self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self._end()
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self._end()
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)

    # llhttp's callbacks

    def on_message_begin(self) -> None:
        if not self._expecting:
            raise Malformed("data the instance sent with no request on the connection")
        self.fields = {}

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:  # interim: its fields are not the answer's
            self._interim = True
            return
        self.status = status
        self.head_done = True
        chunked = self.fields.get("transfer-encoding", "").lower().endswith("chunked")
        self._to_close = (
            not chunked and "content-length" not in self.fields and status not in (204, 304)
        )
        self.keep_alive = self._parser.should_keep_alive() and not self._to_close

    def on_body(self, body: bytes) -> None:
        self._pieces.append(body)
        self._held += len(body)
        self.received += len(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            self.fields = {}
            return
        self.complete = True
        self._expecting = False

    # The reader's side

    def begin(self) -> None:
        """A request was written on the connection: what comes next is its answer."""
        self._expecting = True
        self._head_bytes = 0
        self.status, self.fields, self.head_done, self.complete = 0, {}, False, False
        self.received = 0

    async def head(self) -> tuple[int, dict[str, str]]:
        """The final answer's status and fields."""
        while not self.head_done:
            await self._more()
        return self.status, self.fields

    async def piece(self) -> bytes:
        """The next piece of the body; b"" once it has ended."""
        while not self._pieces:
            if self.complete:
                return b""
            await self._more()
        data = self._pieces.popleft()
        self._held -= len(data)
        return data

    async def _more(self) -> None:
        """Wait until the instance sends more; `Malformed` or `Closed` when it cannot."""
        if self.error is not None:
            raise Malformed(self.error)
        if self.ended:
            raise Closed("the connection ended")
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        assert self._loop is not None, "read before it was connected"
        self._waiter = self._loop.create_future()
        self.deadline = time.monotonic() + self.read_timeout
        try:
            await self._waiter
        finally:
            self.deadline = math.inf

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _end(self) -> None:
        if not self.ended and self.head_done and self._to_close and not self.timed_out:
            self.complete = self.error is None  # a body delimited by the close: it is whole
            self.keep_alive = False
        self.ended = True
        self._wake()

    def _refuse(self, reason: str) -> None:
        self.error = reason
        if self.transport is not None:
            self.transport.abort()

    def reusable(self) -> bool:
        return (
            not self.ended
            and self.error is None
            and not self._expecting
            and not self._pieces
            and self.transport is not None
        )

    def write(self, data: bytes) -> None:
        """Send `data`; `Closed` if the instance has already closed the connection (one that
        answers at once and closes, as a server over its connection cap does, can do so
        before the request is written: uvloop then raises on the write, asyncio drops it)."""
        assert self.transport is not None, "written before it was connected"
        if self.ended or self.transport.is_closing():
            raise Closed("the connection ended before the request was written")
        self.transport.write(data)

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    async def wait_closed(self) -> None:
        if self._lost is not None:
            await self._lost
