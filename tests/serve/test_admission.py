"""Admission's counts, job by job (no engine: the counts live on the event loop, and a job's
first output is what the engine loop delivers through `Job.put`)."""

from __future__ import annotations

import asyncio

import pytest

from kvconnect.engine.request import SamplingParams
from kvconnect.serve.admission import Admission
from kvconnect.serve.engine_loop import Failed, Job, Update


def jobs(loop: asyncio.AbstractEventLoop, num_jobs: int, num_tokens: int) -> list[Job]:
    return [Job([1] * num_tokens, SamplingParams(max_tokens=1), loop) for _ in range(num_jobs)]


async def received(job: Job) -> Update | Failed:
    """The next item delivered to `job` (its delivery has run); fails after 10 s."""
    return await asyncio.wait_for(job.updates.get(), 10)


def test_requests_are_refused_over_either_limit_and_admitted_again_as_jobs_start() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        admission = Admission(max_num_waiting=10, max_num_waiting_tokens=1000)
        first = jobs(loop, 8, 100)
        assert admission.admit(first) is None
        assert (admission.num_waiting, admission.num_waiting_tokens) == (8, 800)
        refused = admission.admit(jobs(loop, 3, 1))  # 11 jobs: over the count
        assert refused is not None and refused.status == 503
        assert "--max-num-waiting" in refused.message
        assert admission.admit(jobs(loop, 1, 201)) is not None  # 1001 tokens: over the tokens
        assert admission.admit(jobs(loop, 2, 100)) is None  # exactly at both limits
        assert (admission.num_waiting, admission.num_waiting_tokens, admission.num_refused) == (
            10,
            1000,
            2,
        )
        # First outputs (and failures) as the engine loop delivers them: those stop waiting;
        # an update with no token yet (the third) does not.
        sent = [Update("a", [5]), Failed("refused", 400), Update("", [])]
        for job, item in zip(first[:3], sent, strict=True):
            job.put(item)
        # A delivery runs on the loop: it counts, then queues the item for the job's reader.
        assert [await received(job) for job in first[:3]] == sent
        assert (admission.num_waiting, admission.num_waiting_tokens) == (8, 800)
        first[0].put(Update("b", [6]))  # a second output counts nothing more
        assert await received(first[0]) == Update("b", [6])
        assert admission.num_waiting == 8
        admission.release(first)  # aborted: the ones not started stop counting, once
        admission.release(first)
        assert (admission.num_waiting, admission.num_waiting_tokens) == (2, 200)

    asyncio.run(main())


def test_a_request_over_the_limits_alone_is_admitted_when_nothing_waits() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        admission = Admission(max_num_waiting=4, max_num_waiting_tokens=100)
        big = jobs(loop, 64, 50)
        assert admission.admit(big) is None
        assert admission.admit(jobs(loop, 1, 1)) is not None
        admission.release(big)
        assert admission.num_waiting == 0

    asyncio.run(main())


def test_a_prompt_over_the_context_never_counts() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        admission = Admission(max_num_waiting=4, max_num_waiting_tokens=100, max_prompt_tokens=64)
        assert admission.admit(jobs(loop, 1, 10)) is None
        assert admission.admit(jobs(loop, 1, 3_000_000)) is None  # the engine's 400, at once
        assert (admission.num_waiting, admission.num_waiting_tokens) == (1, 10)

    asyncio.run(main())


@pytest.mark.parametrize("field", ["max_num_waiting", "max_num_waiting_tokens"])
def test_limits_are_positive(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Admission(**{field: 0})
