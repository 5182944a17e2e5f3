"""The engine boundary of `kvconnect serve`: a request the engine refuses fails alone; a dead
worker fails everything in flight, and the server exits non-zero within seconds."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from kvconnect.engine.llm import LLM
from kvconnect.engine.request import SamplingParams
from kvconnect.serve.engine_loop import EngineLoop, Failed, Job, Update
from tests.serving import Serve

pytestmark = pytest.mark.slow


async def outcome(job: Job) -> Update | Failed:
    while True:
        update = await job.updates.get()
        if isinstance(update, Failed) or update.request is not None:
            return update


def test_a_request_the_engine_refuses_fails_alone() -> None:
    llm = LLM("tiny")
    fatal: list[str] = []
    engine = EngineLoop(llm, on_fatal=fatal.append)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        good = Job(list(b"hello"), SamplingParams(max_tokens=8, ignore_eos=True), loop)
        bad = Job([999], SamplingParams(max_tokens=8), loop)  # not in the vocabulary
        engine.submit(good)
        engine.submit(bad)
        refused, done = await asyncio.gather(outcome(bad), outcome(good))
        assert isinstance(refused, Failed) and refused.status == 400
        assert "999" in refused.message
        assert isinstance(done, Update) and done.request is not None
        assert len(done.request.output_token_ids) == 8
        assert good.admitted.result() is None  # each job heard the verdict first
        assert bad.admitted.result() is refused
        after = Job(list(b"again"), SamplingParams(max_tokens=2), loop)
        engine.submit(after)
        assert isinstance(await outcome(after), Update)

    try:
        asyncio.run(run())
        assert not fatal and engine.error is None and engine.num_active == 0
    finally:
        engine.stop()
        llm.shutdown()


def test_a_job_aborted_before_the_engine_takes_it_never_runs() -> None:
    llm = LLM("tiny")
    engine = EngineLoop(llm)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        left = Job(list(b"gone"), SamplingParams(max_tokens=8000, ignore_eos=True), loop)
        engine.abort(left)  # the abort is seen first, as when its client leaves at once
        engine.submit(left)
        after = Job(list(b"next"), SamplingParams(max_tokens=2, ignore_eos=True), loop)
        engine.submit(after)  # taken after `left` (one queue)
        assert isinstance(await outcome(after), Update)
        assert not left.admitted.done() and left.updates.empty()

    try:
        asyncio.run(run())
        assert engine.num_active == 0 and not llm.has_unfinished_requests
    finally:
        engine.stop()
        llm.shutdown()


def test_a_dead_worker_fails_what_is_in_flight_and_refuses_more() -> None:
    llm = LLM("tiny", distributed_executor_backend="mp")
    fatal = threading.Event()
    engine = EngineLoop(llm, on_fatal=lambda _: fatal.set())

    async def run() -> None:
        loop = asyncio.get_running_loop()
        long = Job(list(b"long"), SamplingParams(max_tokens=8000, ignore_eos=True), loop)
        engine.submit(long)
        assert isinstance(await long.updates.get(), Update)  # it is generating
        (pid,) = llm.executor.worker_pids
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        failed = await outcome(long)
        assert isinstance(failed, Failed) and failed.status == 503
        assert "worker 0" in failed.message

    try:
        start = time.monotonic()
        asyncio.run(run())
        assert fatal.wait(10) and time.monotonic() - start < 30
        assert engine.error is not None and "worker 0 died" in engine.error
        with pytest.raises(RuntimeError, match="worker 0"):
            engine.submit(Job([1], SamplingParams(max_tokens=1), asyncio.new_event_loop()))
    finally:
        engine.stop()
        llm.shutdown()


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found += [int(c) for c in text]
    return found


def worker_pids(pid: int) -> list[int]:
    """The worker processes of the engine in process `pid`: the children of its
    multiprocessing fork server (engine/multiproc_executor.py)."""
    servers = [c for c in children(pid) if b"forkserver" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return [w for s in servers for w in children(s)]


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.heavy)])
def test_serve_exits_non_zero_with_one_line_when_a_worker_dies(tmp_path: Path, tp: int) -> None:
    server = Serve(tmp_path, "--tp", str(tp), "--distributed-executor-backend", "mp")
    server.start()
    try:
        workers = worker_pids(server.pid)
        assert len(workers) == tp
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        body = {"prompt": "x", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        conn.request("POST", "/v1/completions", body=json.dumps(body))
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data: ")  # it is generating
        os.kill(workers[-1], signal.SIGKILL)
        start = time.monotonic()
        rest = resp.read().decode()
        assert '"type": "service_unavailable"' in rest and "died" in rest
        assert rest.endswith("data: [DONE]\n\n")
        assert server.proc is not None
        assert server.proc.wait(timeout=20) == 1
        assert time.monotonic() - start < 10
        errors = [line for line in server.logs().splitlines() if " ERROR " in line]
        assert len(errors) == 1 and "the engine failed" in errors[0] and "died" in errors[0]
    finally:
        server.kill()
