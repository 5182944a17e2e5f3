"""One keep-alive HTTP/1.1 connection to an instance, as an `asyncio.Protocol` (`client.py`
speaks HTTP over it).

What the instance sends is kept in one buffer until the request on the connection takes it:
a response head is looked for once per arrival, a body of known length is taken in one copy
once it is all there, and the waiting request is woken once per arrival. Through asyncio's
StreamReader/StreamWriter the same relay cost about 30 us more CPU per request here
(`bench/routers.py`, the front's own cost). Reading pauses while more than MAX_BUFFERED bytes
wait (a streamed answer whose client is slower than its instance), unless the reader needs
that many at once (a whole body).

    conn.readuntil(b"\r\n\r\n")   ValueError when MAX_HEADER_BYTES come without it
    conn.readexactly(n)             `Closed` if the connection ends first
    conn.read(n)                    what is there (at most n), b"" once the connection ended
Each wait restarts the instance's allowance of silence: `deadline`, which the pool's watchdog
enforces by `abort()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from typing import cast

MAX_HEADER_BYTES = 64 << 10
"""The status line and headers of one response (or a chunk's size line), at most."""
MAX_BUFFERED = 256 << 10
"""Bytes of a streamed answer held before reading from the instance pauses (until the relay
has passed them on to its client)."""


class Closed(ConnectionError):
    """The connection ended (the instance closed it, or it was aborted) before the bytes a
    reader waits for arrived."""


class Connection(asyncio.Protocol):
    """One connection: what the instance sent, buffered until its reader takes it. One reader
    at a time (the request on it) waits in `_more()`, which also restarts the instance's
    allowance of silence (`deadline`)."""

    def __init__(self, read_timeout: float) -> None:
        self.read_timeout = read_timeout
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.want = MAX_BUFFERED
        """Bytes the reader needs buffered at once (a whole body): reading pauses over this."""
        self.deadline = 0.0
        """While a request is on it: when the instance's silence becomes a timeout."""
        self.timed_out = False
        self.ended = False
        """No more data will come (the instance closed its side, or the connection is lost)."""
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._lost: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are no subclass of it
        sock = transport.get_extra_info("socket")
        if sock is not None:  # asyncio and uvloop set it as well: a request is one write
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._loop = asyncio.get_running_loop()  # once: each lookup is a getpid() syscall
        self._lost = self._loop.create_future()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > self.want and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.ended = True
        self._wake()
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        self._wake()
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _more(self) -> None:
        """Wait until more bytes arrive; `Closed` when none can."""
        if self.ended:
            raise Closed("the connection ended")
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        self.deadline = time.monotonic() + self.read_timeout
        assert self._loop is not None, "read before it was connected"
        self._waiter = self._loop.create_future()
        await self._waiter

    def _take(self, n: int) -> bytes:
        data = bytes(self.buffer[:n])
        del self.buffer[:n]
        return data

    async def readuntil(self, separator: bytes) -> bytes:
        """Up to and including `separator`; ValueError when more than MAX_HEADER_BYTES come
        without it."""
        start = 0
        while (end := self.buffer.find(separator, start)) < 0:
            if len(self.buffer) > MAX_HEADER_BYTES:
                raise ValueError(f"over {MAX_HEADER_BYTES} bytes without {separator!r}")
            start = max(0, len(self.buffer) - len(separator) + 1)
            await self._more()
        return self._take(end + len(separator))

    async def readexactly(self, n: int) -> bytes:
        """`n` bytes, taken in one copy once all have arrived."""
        self.want = max(n, MAX_BUFFERED)
        try:
            while len(self.buffer) < n:
                await self._more()
        finally:
            self.want = MAX_BUFFERED
        return self._take(n)

    async def read(self, n: int) -> bytes:
        """What is buffered, at most `n` bytes (waiting for some when none is); b"" once the
        connection has ended."""
        if not self.buffer and not self.ended:
            with contextlib.suppress(Closed):
                await self._more()
        return self._take(n)

    def reusable(self) -> bool:
        return not self.ended and not self.buffer and self.transport is not None

    def write(self, data: bytes) -> None:
        assert self.transport is not None, "written before it was connected"
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
