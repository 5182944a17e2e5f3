"""The thread that owns an `LLM` for a server: takes requests, steps, hands back text.

    HTTP handlers --submit(Job)--> [queue] --> engine thread: add_request, step, step, ...
                 <--job.admitted, job.updates (via the event loop)-- the verdict on the job,
                                                                     then each step's deltas

The engine is single-threaded; only this thread touches it, and only through `LLM`'s own
surface (add_request, step, abort, check_alive). What a front needs to know of the engine
before it submits (the tokenizer, the limits) is `info`, fixed at start.

Each job first hears whether the engine took it (`Job.admitted`): the engine checks its prompt
there, once. A job that the engine refuses (a prompt too long, a token outside the
vocabulary) fails alone with a 400: its handler gets the error and every other job goes on.
Then each step's `RequestDelta` of the job's request becomes one `Update`. A failure of the
engine itself (a worker died or hung, a step raised) is fatal: every job gets the error,
`error` is set (health turns 503), and `on_fatal` is called once so the server can exit: a
supervisor restarts it, as with vLLM. While idle the thread also checks that the workers are
alive, so a dead worker is noticed without traffic.
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
from typing import Any

from kvconnect.engine.llm import LLM, EngineInfo, RequestDelta
from kvconnect.engine.request import Request, SamplingParams
from kvconnect.messages import PositionLogprobs

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
    logprobs: list[PositionLogprobs] | None = None
    """One per token of token_ids, if the job asked (`SamplingParams.logprobs`)."""
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    """With the first update that has tokens, if the job asked: one per prompt token."""


@dataclass
class Failed:
    message: str
    status: int
    """400: the engine refused this job; 503: the engine is gone."""


@dataclass
class Job:
    """One completion choice: a prompt and its sampling, and where its results go.

    `admitted` resolves first: None once the engine has taken the job, or the `Failed` that
    also comes on `updates` when it never will. Results are set on `loop`, in order.
    """

    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    updates: asyncio.Queue[Update | Failed] = field(default_factory=asyncio.Queue)
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    submitted: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    admitted: asyncio.Future[Failed | None] = field(init=False)
    aborted: bool = field(default=False, init=False)
    """Set by `EngineLoop.abort`: a job not taken yet never reaches the engine."""
    on_started: Callable[[Job], None] | None = field(default=None, init=False)
    """Called on the event loop with the job's first output or failure (admission's count
    of waiting jobs, `serve/admission.py`), then cleared by its callee."""

    def __post_init__(self) -> None:
        self.admitted = self.loop.create_future()

    def put(self, item: Update | Failed) -> None:
        """Deliver `item` (from any thread); a failure before admission is its verdict too."""
        self.loop.call_soon_threadsafe(self._deliver, item)

    def admit(self) -> None:
        """The engine has taken the job (from any thread)."""
        self.loop.call_soon_threadsafe(self._settle, None)

    def _deliver(self, item: Update | Failed) -> None:
        self._settle(item if isinstance(item, Failed) else None)
        if self.on_started is not None and (
            isinstance(item, Failed) or item.token_ids or item.request is not None
        ):
            self.on_started(self)
        self.updates.put_nowait(item)

    def _settle(self, verdict: Failed | None) -> None:
        if not self.admitted.done():
            self.admitted.set_result(verdict)


class EngineLoop:
    def __init__(
        self,
        llm: LLM,
        on_fatal: Callable[[str], None] | None = None,
        on_finished: Callable[[Job, Request], None] | None = None,
    ) -> None:
        self.info: EngineInfo = llm.info
        self.on_fatal = on_fatal
        self.on_finished = on_finished
        self.error: str | None = None
        self._llm = llm
        self._incoming: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._aborts: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._active: dict[str, Job] = {}
        self._thread = threading.Thread(target=self._run, name="kvconnect-engine", daemon=True)
        self._thread.start()

    @property
    def num_active(self) -> int:
        return len(self._active)

    def stalled(self) -> str | None:
        """What keeps the engine's connector from progress now (a stuck I/O job), if
        anything; any thread may ask."""
        return self._llm.stats().connector_health

    def submit(self, job: Job) -> None:
        """Queue `job` for the engine (`RuntimeError` once the engine has failed); its
        verdict comes on `job.admitted`."""
        if self.error is not None:
            raise RuntimeError(self.error)
        self._incoming.put(job)
        self._fail_if_dead(job)

    def _fail_if_dead(self, job: Job) -> None:
        """If the engine failed while `job` was being queued, `_fatal` may have drained the
        queue before it: fail it here (a second `Failed` is harmless, consumers stop at one)."""
        if self.error is not None:
            job.put(Failed(self.error, 503))

    def abort(self, job: Job) -> None:
        """The client went away: stop generating for it (ignored once it finished)."""
        job.aborted = True  # before the id: the engine thread reads the flag when it takes it
        self._aborts.put(job.request_id)

    def stop(self, timeout: float = 10.0) -> None:
        self._incoming.put(None)
        self._thread.join(timeout)

    # -- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._turn():
                pass
        except Exception as e:  # the engine is gone: everyone hears it, the server exits
            self._fatal(f"the engine failed: {type(e).__name__}: {e}")

    def _turn(self) -> bool:
        """Aborts, then one incoming job or one step; False once asked to stop."""
        llm = self._llm
        self._take_aborts()
        busy = llm.has_unfinished_requests or llm.has_pending_transfers
        try:
            # Busy: take every waiting job before the next step. Idle: wait, a while.
            job = self._incoming.get(block=not busy, timeout=IDLE_CHECK_S)
        except queue.Empty:
            if not busy:
                llm.check_alive()
                # Idle with a connector: step anyway, so that stores finishing in the
                # background are reported and published without new traffic.
                if not llm.needs_idle_steps:
                    return True
        else:
            if job is None:
                return False
            self._take(job)
            return True
        self._route(llm.step())
        return True

    def _take_aborts(self) -> None:
        gone = []
        while True:
            try:
                request_id = self._aborts.get_nowait()
            except queue.Empty:
                break
            if self._active.pop(request_id, None) is not None:
                gone.append(request_id)
        if gone:
            self._llm.abort(gone)

    def _take(self, job: Job) -> None:
        if job.aborted:
            return  # its client left before the engine took it
        try:
            self._llm.add_request(
                job.prompt,
                job.params,
                request_id=job.request_id,
                cache_salt=job.cache_salt,
                kv_transfer_params=job.kv_transfer_params,
            )
        except (ValueError, TypeError) as e:
            job.put(Failed(str(e), 400))
            return
        self._active[job.request_id] = job
        job.admit()

    def _route(self, deltas: list[RequestDelta]) -> None:
        """Each delta to its job; a finished one ends the job."""
        for delta in deltas:
            job = self._active.get(delta.request_id)
            if job is None:
                continue  # none expected: an aborted request is gone from the engine too
            if delta.token_ids and job.first_token_at is None:
                job.first_token_at = time.monotonic()
            update = Update(
                delta.text,
                delta.token_ids,
                logprobs=delta.logprobs,
                prompt_logprobs=delta.prompt_logprobs,
            )
            if delta.finished:
                update.finish_reason = delta.finish_reason
                update.stop_reason = delta.stop_reason
                update.request = delta.request
                del self._active[delta.request_id]
                if self.on_finished is not None:
                    self.on_finished(job, delta.request)
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
