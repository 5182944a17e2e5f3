"""The two peers, as processes the tests talk to.

VllmRouter   vllm-router 0.1.17, kv_aware; its debug log read line by line:
             `wait_applied(url, seq)`, and `probe(tokens)` -> its `Decision`
Dynamo       Dynamo's standalone indexer in a network namespace of its own (conftest.py
             says how it is networked); `query(tokens)`, and its own counters:
             `num_applied()`, `faults()`
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests_peers.support import (
    BLOCK_SIZE,
    MODEL,
    WAIT,
    Proc,
    T,
    completion,
    free_port,
    http,
    wait_for,
    wait_http,
)

HERE = Path(__file__).resolve().parent

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_DECISION = re.compile(
    r'KV prefix decision .*?worker="(?P<worker>[^"]+)" input_tokens=(?P<input>\d+) '
    r"new_prefill_tokens=(?P<new>\d+) credited_prefix_tokens=(?P<credited>\d+)"
)
_APPLIED = re.compile(r"kv_index \w+ sequence advanced source=(?P<src>\S+) rank=0 seq=(?P<seq>\d+)")


@dataclass(frozen=True)
class Decision:
    """One kv_aware routing decision, from vllm-router's debug log."""

    worker: str
    input_tokens: int
    new_prefill_tokens: int
    credited_prefix_tokens: int
    """Prefix tokens it credits the chosen worker with: GPU blocks in full, others at the
    tier's credit (`--kv-penalty-host` for CPU, `--kv-penalty-disk`, `--kv-penalty-external`)."""


class VllmRouter:
    """vllm-router 0.1.17, `--policy kv_aware`, following `sources` (worker URL -> (events,
    replay)), at log level debug: its log is how it shows what it applied and decided."""

    CREDIT = {"host": 0.5, "external": 0.75, "disk": 0.25}
    """Tier credits set apart from each other and from its defaults (0.8, 0.6, 0.3), so the
    credit of a decision tells which kind of tier it filed a block under."""

    def __init__(
        self,
        venv: Path,
        sources: dict[str, tuple[str, str]],
        workdir: Path,
        block_size: int = BLOCK_SIZE,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            str(venv / "bin" / "vllm-router"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            "--policy",
            "kv_aware",
            "--kv-event-block-size",
            str(block_size),
            "--kv-event-model",
            MODEL,
            "--kv-penalty-host",
            str(self.CREDIT["host"]),
            "--kv-penalty-external",
            str(self.CREDIT["external"]),
            "--kv-penalty-disk",
            str(self.CREDIT["disk"]),
            "--log-level",
            "debug",
        ]
        for url, (events, replay) in sources.items():
            cmd += ["--kv-event-source", f"{url}={events}"]
            cmd += ["--kv-event-replay-source", f"{url}={replay}"]
        cmd += ["--worker-urls", *sources]
        self.decisions: list[Decision] = []
        self.applied: dict[str, int] = {}
        self.ready = False
        self._lines = threading.Condition()
        popen = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.proc = Proc(popen, workdir / "vllm-router.log")
        self._reader = threading.Thread(target=self._read, name="vllm-router-log", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        """Its output, line by line: into its log file (colors stripped), and parsed."""
        stdout = self.proc.popen.stdout
        assert stdout is not None
        with open(self.proc.log, "w") as log:
            for raw in stdout:
                line = _ANSI.sub("", raw.decode(errors="replace"))
                log.write(line)
                log.flush()
                with self._lines:
                    if found := _DECISION.search(line):
                        self.decisions.append(
                            Decision(
                                found["worker"],
                                int(found["input"]),
                                int(found["new"]),
                                int(found["credited"]),
                            )
                        )
                    elif found := _APPLIED.search(line):
                        src, seq = found["src"], int(found["seq"])
                        self.applied[src] = max(seq, self.applied.get(src, -1))
                    elif "Router ready" in line:
                        self.ready = True
                    self._lines.notify_all()
        with self._lines:  # it exited: wake any waiter
            self._lines.notify_all()

    def _wait(self, what: str, check: Callable[[], T | None]) -> T:
        """`check()`'s first value that is not None, asked at each line of its log."""
        found: list[T] = []

        def done() -> bool:
            value = check()
            if value is not None:
                found.append(value)
            return bool(found) or self.proc.popen.poll() is not None

        with self._lines:
            self._lines.wait_for(done, WAIT)
        if found:
            return found[0]
        self.proc.check_running("vllm-router")
        pytest.fail(f"vllm-router: timed out waiting for {what}\n{self.proc.tail()}")

    def _decision_after(self, num: int) -> Decision:
        return self._wait(
            "its decision", lambda: self.decisions[num] if len(self.decisions) > num else None
        )

    def wait_ready(self) -> None:
        self._wait("Router ready", lambda: self.ready or None)

    def wait_applied(self, worker_url: str, seq: int) -> None:
        """Until its index has applied `worker_url`'s stream up to `seq` (live or replayed)."""
        self._wait(
            f"{worker_url} seq {seq}",
            lambda: True if self.applied.get(worker_url, -1) >= seq else None,
        )

    def probe(self, tokens: list[int]) -> Decision:
        """Where it routes `tokens`, without any engine work: the request is routed (the
        decision is logged first), and the chosen instance rejects it (temperature -1) before
        it schedules anything, so no block is stored or touched anywhere."""
        with self._lines:
            num = len(self.decisions)
        status, body = http(self.url + "/v1/completions", completion(tokens, temperature=-1))
        assert status == 400, (status, body)
        return self._decision_after(num)

    def complete(self, tokens: list[int]) -> tuple[Decision, dict[str, Any]]:
        """Serve `tokens` through it: (its decision, the serving instance's usage)."""
        with self._lines:
            num = len(self.decisions)
        status, body = http(self.url + "/v1/completions", completion(tokens))
        assert status == 200, body
        return self._decision_after(num), body["usage"]

    def stop(self) -> None:
        self.proc.stop()
        self._reader.join(timeout=5)


class Dynamo:
    """Dynamo's standalone KV indexer (`python -m dynamo.indexer`), started by `unshare -n`
    in a network namespace of its own, with a relay that exposes its HTTP port as a Unix
    socket. `workers`: Dynamo worker id -> the ipc:// address (a relay, see conftest.py) of
    that worker's kvconnect stream."""

    PORT = 8090  # inside its own namespace: nothing else binds there
    APPLIED = "dynamo_kvrouter_kv_cache_events_applied"

    def __init__(
        self, venv: Path, workers: dict[int, str], workdir: Path, block_size: int = BLOCK_SIZE
    ) -> None:
        self.socket = workdir / "dynamo-http"
        indexer = [
            str(venv / "bin" / "python"),
            "-m",
            "dynamo.indexer",
            "--port",
            str(self.PORT),
            "--block-size",
            str(block_size),
            "--model-name",
            MODEL,
            "--threads",  # one indexer thread: each worker's events applied in stream order
            "1",
            "--workers",
            ",".join(f"{wid}={addr}" for wid, addr in workers.items()),
        ]
        relay = [sys.executable, str(HERE / "relay.py"), f"{self.socket}={self.PORT}"]
        # A new network namespace has only a loopback interface, and it starts down.
        script = f"ip link set lo up || exit 1\n{shlex.join(relay)} &\nexec {shlex.join(indexer)}\n"
        unshare = ["unshare", "--net"] if os.geteuid() == 0 else ["unshare", "-r", "--net"]
        self.proc = Proc.start([*unshare, "--", "sh", "-c", script], workdir / "dynamo.log")

    def wait_ready(self, num_workers: int) -> None:
        wait_http("/health", self.proc, "Dynamo's indexer", unix=self.socket)

        def listening() -> bool | None:
            _, workers = http("/workers", unix=self.socket)
            active = [
                listener["status"] == "active"
                for worker in workers
                for listener in worker["listeners"].values()
            ]
            return True if len(active) == num_workers and all(active) else None

        wait_for("Dynamo's listeners", listening)

    def query(self, tokens: list[int]) -> dict[str, Any]:
        status, body = http("/query", {"token_ids": tokens, "model_name": MODEL}, unix=self.socket)
        assert status == 200, body
        result: dict[str, Any] = body
        return result

    def num_applied(self) -> dict[str, int]:
        """Events it applied without fault, by kind: its own `stored`, `removed`, `cleared`
        counters (its `stored` counts GPU stores only; a tier's go to its tier index)."""
        metrics = self.metrics()
        return {
            kind: int(metrics.get(f'{self.APPLIED}{{event_type="{kind}",status="ok"}}', 0))
            for kind in ("stored", "removed", "cleared")
        }

    def faults(self) -> dict[str, float]:
        """Its counters of events applied with a fault (unknown parent, unknown block, ...)
        and of suspicious events (a duplicate store), where not zero."""
        return {
            key: value
            for key, value in self.metrics().items()
            if value
            and ((key.startswith(self.APPLIED) and 'status="ok"' not in key) or "warning" in key)
        }

    def metrics(self) -> dict[str, float]:
        """Its Prometheus samples, keyed by the sample's name and labels as written."""
        _, text = http("/metrics", unix=self.socket)
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                samples[key] = float(value)
        return samples

    def stop(self) -> None:
        self.proc.stop()


def tiers(answer: dict[str, Any], worker_id: int) -> dict[str, int]:
    """A worker's matched tokens per tier in Dynamo's answer (all 0 when it matched nothing).
    Dynamo counts them cumulatively: `cpu` is matched in GPU or host memory, `disk` in any
    tier."""
    found = answer["instances"].get(str(worker_id), {})
    return {k: int(found.get(k, 0)) for k in ("longest_matched", "gpu", "cpu", "disk")}
