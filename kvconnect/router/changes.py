"""Requests waiting on the event loop for the router's state to change: the index (a batch
applied, an instance synced) or a prefill (one ending). The stream thread and the loop both
wake them (`wake`); a waiter registers (`future`) before it looks, so no change is missed
between its look and its wait."""

from __future__ import annotations

import asyncio
import threading


class Changes:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def future(self) -> asyncio.Future[None]:
        """Resolved at the next `wake`; look at the state after taking it, then await it."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            self._waiting.append((loop, future))
        return future

    def __bool__(self) -> bool:
        """Someone waits (else a change need wake no one)."""
        return bool(self._waiting)

    def wake(self) -> None:
        """Every waiter looks again; from any thread."""
        with self._lock:
            waiting, self._waiting = self._waiting, []
        for loop, future in waiting:
            loop.call_soon_threadsafe(_resolve, future)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
