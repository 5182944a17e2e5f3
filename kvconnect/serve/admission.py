"""Admission control: how much work may wait for the engine before new requests are refused.

A job (one choice of one prompt) is *waiting* from the moment the server hands it to the
engine until its first output arrives (or it fails, or its client leaves): it sits in the
engine's queue or in its prefill. Two bounds, both counted over every waiting job of every
request, with n x prompts jobs per request (one request may be 64 prompts x n=16):

    max_num_waiting          jobs waiting at most
    max_num_waiting_tokens   their prompt tokens at most

A request that would go over either is refused at once with a 503 and `Retry-After` (the
server is overloaded, not the client over a quota: 429 would say the latter; vLLM and llm-d's
gateways answer overload with 503 too), unless nothing is waiting: then it is admitted
whatever its size, so that a request the protocol allows is never refused for ever. A request
already running is never stopped by admission. A prompt longer than the model's context
(`max_prompt_tokens`) does not count: the engine refuses it (a 400) the moment it takes it, so
it never waits, and a huge prompt must not turn other clients away with 503s on its way to its
own 400. Used on the event loop only.

    admitted = admission.admit(jobs)        None, or the ApiError (503) to answer with
    ... the engine loop calls job.on_started once per job (first output, failure)
    admission.release(jobs)                 on abort: jobs not yet started stop counting
"""

from __future__ import annotations

from kvconnect.api.protocol import ApiError
from kvconnect.serve.engine_loop import Job

MAX_NUM_WAITING = 1024
MAX_NUM_WAITING_TOKENS = 1 << 20
RETRY_AFTER_S = 1


class Admission:
    def __init__(
        self,
        max_num_waiting: int = MAX_NUM_WAITING,
        max_num_waiting_tokens: int = MAX_NUM_WAITING_TOKENS,
        max_prompt_tokens: int | None = None,
    ) -> None:
        for name, value in (
            ("max_num_waiting", max_num_waiting),
            ("max_num_waiting_tokens", max_num_waiting_tokens),
        ):
            if value < 1:
                raise ValueError(f"{name}={value}: must be at least 1")
        self.max_num_waiting = max_num_waiting
        self.max_num_waiting_tokens = max_num_waiting_tokens
        self.max_prompt_tokens = max_prompt_tokens
        self.num_waiting = self.num_waiting_tokens = self.num_refused = 0

    def admit(self, jobs: list[Job]) -> ApiError | None:
        """Count `jobs` as waiting, or the 503 that refuses them all."""
        limit = self.max_prompt_tokens
        if limit is not None:
            jobs = [job for job in jobs if len(job.prompt) <= limit]
        num_tokens = sum(len(job.prompt) for job in jobs)
        busy = self.num_waiting > 0
        if busy and (
            self.num_waiting + len(jobs) > self.max_num_waiting
            or self.num_waiting_tokens + num_tokens > self.max_num_waiting_tokens
        ):
            self.num_refused += 1
            return ApiError(
                f"the server is overloaded: {self.num_waiting} requests "
                f"({self.num_waiting_tokens} prompt tokens) wait for the engine, and this one "
                f"would add {len(jobs)} ({num_tokens}); the limits are "
                f"{self.max_num_waiting} (--max-num-waiting) and {self.max_num_waiting_tokens} "
                f"(--max-num-waiting-tokens); retry in {RETRY_AFTER_S} s",
                status=503,
                type_="service_unavailable",
            )
        self.num_waiting += len(jobs)
        self.num_waiting_tokens += num_tokens
        for job in jobs:
            job.on_started = self._started
        return None

    def _started(self, job: Job) -> None:
        job.on_started = None
        self.num_waiting -= 1
        self.num_waiting_tokens -= len(job.prompt)

    def release(self, jobs: list[Job]) -> None:
        """Jobs that end before their first output (aborted) stop counting."""
        for job in jobs:
            if job.on_started is not None:
                job.on_started(job)


__all__ = ["RETRY_AFTER_S", "Admission"]
