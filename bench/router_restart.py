"""A router restarted under load makes no cold decision (issue 47): one line.

Two `kvconnect serve --model tiny` instances (a cpu tier; KV event ports the OS's, named at
GET /kv_event_sources) behind `kvconnect router --instance URL` (discovered). Load flows the
whole time: LOAD_THREADS clients send new prompts straight to the instances (their streams
never rest) and through the router. Each round, HELD new prompts are computed on known
instances (half on each), then the router is killed (SIGKILL) and started again, and the HELD
prompts go through it at once, the moment it says it is ready.

A cold decision is one made before the router's index had the instances' state: the router
counts those made after its sync wait ran out (`kvconnect_router_decisions_unsynced_total`),
and a held prompt answered by an instance that is not its holder was decided without it.
Reported: cold decisions of both kinds over every round, and how long the first decisions
waited: each round's first answer after ready, against the same kind of request on the warm
router (its limit, measured in the same run: the ratio is the wait's cost).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROUNDS = 3
HELD = 8
"""Prompts computed on known instances before each restart, sent at once after it."""
PROMPT_TOKENS = 160
LOAD_THREADS = 2
READY_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def prompt(seed: int, n: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def complete(url: str, tokens: list[int], timeout: float = 60.0) -> tuple[str, float]:
    """(the instance that answered: the router's header, else `url`; seconds taken)."""
    body = json.dumps({"prompt": tokens, "max_tokens": 2}).encode()
    req = urllib.request.Request(
        url + "/v1/completions", body, {"Content-Type": "application/json"}
    )
    start = time.monotonic()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        resp.read()
        return resp.headers.get("x-kvconnect-instance") or url, time.monotonic() - start


class Command:
    """A kvconnect command, ready once it prints its ready line."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.args, self.log = args, log
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> float:
        """Start and wait for the ready line; when it came (time.monotonic)."""
        with open(self.log, "a") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvconnect.cli", *self.args],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                start_new_session=True,
            )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + READY_S
        for line in self.proc.stdout:
            if "ready at" in line:
                threading.Thread(target=self.proc.stdout.read, daemon=True).start()
                return time.monotonic()
            if time.monotonic() > deadline:
                break
        raise RuntimeError(f"{self.args[0]} did not start: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert found, name
    return float(found.group(1))


def load(urls: list[str], stop: threading.Event, seed: int, counts: list[int]) -> None:
    """New prompts, one after another, to each of `urls` in turn until `stop` (bounded by
    the caller's rounds); a router that is down meanwhile is skipped."""
    i = 0
    while not stop.is_set():
        i += 1
        try:
            complete(urls[i % len(urls)], prompt(seed * 1_000_000 + i, 96), timeout=30)
            counts[0] += 1
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.05)


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="router-restart-"))
    events = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0"})
    tier = json.dumps(
        {
            "kv_connector": "OffloadConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "chunk_size": 32,
                "tiers": [{"kind": "cpu", "max_bytes": 64 << 20}],
            },
        }
    )
    ports = [free_port() for _ in range(2)]
    instances = [
        Command(
            ["serve", "--model", "tiny", "--port", str(p), "--kv-events-config", events,
             "--kv-transfer-config", tier],
            tmp / f"serve-{p}.log",
        )
        for p in ports
    ]  # fmt: skip
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    router_port = free_port()
    router_url = f"http://127.0.0.1:{router_port}"
    args = ["router", "--model", "tiny", "--port", str(router_port)]
    for url in urls:
        args += ["--instance", url]
    stop = threading.Event()
    counts = [0]
    cold_unsynced = cold_elsewhere = decisions = 0
    first_waits: list[float] = []
    warm: list[float] = []
    try:
        for c in instances:
            c.start()
        router = Command(args, tmp / "router.log")
        router.start()
        loaders = [
            threading.Thread(target=load, args=([*urls, router_url], stop, k, counts), daemon=True)
            for k in range(LOAD_THREADS)
        ]
        for t in loaders:
            t.start()
        load_start = time.monotonic()
        for r in range(ROUNDS):
            seeds = [10_000 * (r + 1) + k for k in range(HELD)]
            holder = {s: urls[k % 2] for k, s in enumerate(seeds)}
            for s, url in holder.items():  # computed where we know, with load around
                complete(url, prompt(s))
            router.kill()
            router.start()
            answers: dict[int, tuple[str, float]] = {}

            def send(s: int, out: dict[int, tuple[str, float]] = answers) -> None:
                out[s] = complete(router_url, prompt(s))

            threads = [threading.Thread(target=send, args=(s,)) for s in seeds]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            first_waits.append(min(took for _, took in answers.values()))
            decisions += len(answers)
            cold_elsewhere += sum(answers[s][0] != holder[s] for s in seeds)
            cold_unsynced += int(metric(router_url, "kvconnect_router_decisions_unsynced_total"))
            for s in seeds:  # the same requests on the warm router: the limit
                warm.append(complete(router_url, prompt(s))[1])
        elapsed = time.monotonic() - load_start
    finally:
        stop.set()
        for c in [*instances]:
            c.stop()
        if "router" in locals():
            router.stop()
    warm_p50 = statistics.median(warm)
    wait_p50 = statistics.median(first_waits)
    print(
        f"router_restart ({ROUNDS} SIGKILL restarts of a router over 2 tiny instances found by "
        f"/kv_event_sources, {LOAD_THREADS} load clients, {counts[0] / elapsed:.0f} req/s): cold "
        f"decisions {cold_unsynced + cold_elsewhere} of {decisions} (unsynced {cold_unsynced}, "
        f"held prompt to a non-holder {cold_elsewhere}); first answer after ready p50 "
        f"{wait_p50 * 1000:.0f} ms, max {max(first_waits) * 1000:.0f} ms vs warm p50 "
        f"{warm_p50 * 1000:.0f} ms (ratio {wait_p50 / warm_p50:.1f})"
    )


if __name__ == "__main__":
    main()
