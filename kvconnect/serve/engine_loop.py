"""The thread that owns an `LLM` for a server: takes requests, steps, hands back text.

    HTTP handlers --submit(Job)--> [queue] --> engine thread: add_request, step, step, ...
                 <--job.updates (asyncio queue, via the event loop)-- each step's new text

The engine is single-threaded; only this thread touches it. A job that the engine refuses
(a prompt too long, a token outside the vocabulary) fails alone: its handler gets the error and
every other job goes on. A failure of the engine itself (a worker died or hung, a step raised)
is fatal: every job gets the error, `error` is set (health turns 503), and `on_fatal` is called
once so the server can exit: a supervisor restarts it, as with vLLM. While idle the thread also
checks that the workers are alive, so a dead worker is noticed without traffic.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from kvconnect.engine.llm import LLM
from kvconnect.engine.request import Request, SamplingParams

logger = logging.getLogger(__name__)

IDLE_CHECK_S = 0.2


@dataclass
class Update:
    """New output of one job (one choice): text, tokens, and the end when it ends."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    request: Request | None = None
    """Set with the last update: the finished request (usage, cached tokens)."""


@dataclass
class Failed:
    message: str
    status: int
    """400: the engine refused this job; 503: the engine is gone."""


@dataclass
class Job:
    """One completion choice: a prompt and its sampling, and where its updates go."""

    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    updates: asyncio.Queue[Update | Failed] = field(default_factory=asyncio.Queue)
    cache_salt: str | None = None
    submitted: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    _sent_tokens: int = 0

    def put(self, item: Update | Failed) -> None:
        self.loop.call_soon_threadsafe(self.updates.put_nowait, item)


class EngineLoop:
    def __init__(
        self,
        llm: LLM,
        on_fatal: Callable[[str], None] | None = None,
        on_finished: Callable[[Job, Request], None] | None = None,
    ) -> None:
        self.llm = llm
        self.on_fatal = on_fatal
        self.on_finished = on_finished
        self.error: str | None = None
        self._incoming: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._aborts: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._active: dict[str, Job] = {}
        self._thread = threading.Thread(target=self._run, name="kvconnect-engine", daemon=True)
        self._thread.start()

    @property
    def num_active(self) -> int:
        return len(self._active)

    def submit(self, job: Job) -> None:
        if self.error is not None:
            raise RuntimeError(self.error)
        self._incoming.put(job)

    def abort(self, request_id: str) -> None:
        """The client went away: stop generating for it (ignored once it finished)."""
        self._aborts.put(request_id)

    def stop(self, timeout: float = 10.0) -> None:
        self._incoming.put(None)
        self._thread.join(timeout)

    # -- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        llm, sched = self.llm, self.llm.scheduler
        try:
            while True:
                self._take_aborts()
                busy = sched.has_unfinished_requests or sched.has_pending_transfers
                try:
                    if busy:  # take every waiting job before the next step
                        job = self._incoming.get_nowait()
                    else:
                        job = self._incoming.get(timeout=IDLE_CHECK_S)
                except queue.Empty:
                    if not busy:
                        llm.executor.check_alive()
                        # Idle with a connector: step anyway, so that stores finishing in
                        # the background are reported and published without new traffic.
                        if llm.connector is None:
                            continue
                else:
                    if job is None:
                        return
                    self._take(job)
                    continue
                llm.step()
                self._push()
        except Exception as e:  # the engine is gone: everyone hears it, the server exits
            self._fatal(f"the engine failed: {type(e).__name__}: {e}")

    def _take_aborts(self) -> None:
        while True:
            try:
                request_id = self._aborts.get_nowait()
            except queue.Empty:
                return
            if self._active.pop(request_id, None) is not None:
                self.llm.scheduler.abort_request(request_id)
                self.llm.release(request_id)

    def _take(self, job: Job) -> None:
        try:
            self.llm.add_request(
                job.prompt, job.params, request_id=job.request_id, cache_salt=job.cache_salt
            )
        except (ValueError, TypeError) as e:
            job.put(Failed(str(e), 400))
            return
        self._active[job.request_id] = job

    def _push(self) -> None:
        llm = self.llm
        for request_id, job in list(self._active.items()):
            state = llm.output_state(request_id)
            req = state.request
            new_tokens = req.output_token_ids[job._sent_tokens :]
            done = req.status.is_finished
            if not new_tokens and not done:
                continue
            if new_tokens and job.first_token_at is None:
                job.first_token_at = time.monotonic()
            job._sent_tokens = len(req.output_token_ids)
            update = Update(state.take_delta(), new_tokens)
            if done:
                update.finish_reason = req.status.finish_reason
                update.stop_reason = state.stop_reason
                update.request = req
                del self._active[request_id]
                llm.release(request_id)
                if self.on_finished is not None:
                    self.on_finished(job, req)
            job.put(update)

    def _fatal(self, message: str) -> None:
        self.error = message
        logger.error("%s; failing %d request(s) and shutting down", message, len(self._active))
        for job in self._active.values():
            job.put(Failed(message, 503))
        self._active.clear()
        while True:  # jobs still queued hear it too
            try:
                queued = self._incoming.get_nowait()
            except queue.Empty:
                break
            if queued is not None:
                queued.put(Failed(message, 503))
        if self.on_fatal is not None:
            self.on_fatal(message)


__all__ = ["EngineLoop", "Failed", "Job", "Update"]
