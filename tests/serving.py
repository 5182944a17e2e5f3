"""`kvconnect serve` and `kvconnect router` as the tests run them: real processes on loopback,
ready when they print their ready line."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.helpers import SERVE_BASES, free_port, pick_port, worker_ports

READY_TIMEOUT_S = 120.0


class Process:
    """A kvconnect command whose stdout is read line by line (its ready line is the handshake)
    and whose stderr (logs) goes to a file, shown when something fails."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.args, self.log = args, log
        self.proc: subprocess.Popen[str] | None = None
        self.lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self.ready_line = ""
        self.ready_marker = "ready at"
        self.seen: list[str] = []
        """stdout up to the ready line."""
        self.launcher = [sys.executable, "-m", "kvconnect.cli"]
        """How the command is run: this venv's kvconnect, unless a test installed another."""

    def start(self, timeout: float = READY_TIMEOUT_S) -> str:
        """Start (or start again, after a kill) and wait for the ready line. A first start
        that finds a port of its taken (by anything on this machine, between the choice and
        the bind) is tried again on new ports (`new_ports`), twice at most."""
        for _ in range(2):
            try:
                return self._start(timeout)
            except AssertionError:
                if self.ready_line or self.alive() or not self.port_taken():
                    raise
            self.seen = []
            self.new_ports()
        return self._start(timeout)

    def refusal(self, timeout: float = READY_TIMEOUT_S) -> str:
        """The one error line the command exits with (status 2, a bad flag or file) instead
        of becoming ready."""
        try:
            self.start(timeout)
        except AssertionError:
            pass
        else:
            self.kill()
            raise AssertionError(f"it started and served: {self.ready_line}")
        assert self.proc is not None and self.proc.returncode == 2, self.logs()
        errors = [line for line in self.logs().splitlines() if ": error: " in line]
        assert len(errors) == 1, self.logs()
        return errors[0]

    def port_taken(self) -> bool:
        """Whether the start that just failed found a port of its in use."""
        return "Address already in use" in self.logs()

    def new_ports(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} chooses no ports of its own")

    def command(self) -> list[str]:
        """The kvconnect command line, read at each start."""
        return self.args

    def _start(self, timeout: float) -> str:
        self.lines = queue.SimpleQueue()
        with open(self.log, "a") as err:
            self.proc = subprocess.Popen(
                [*self.launcher, *self.command()],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                start_new_session=True,
            )
        threading.Thread(target=self._read, args=(self.proc, self.lines), daemon=True).start()
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no ready line in {timeout}s; log:\n{self.logs()}") from None
            if line is None:
                raise AssertionError(f"exited {self.proc.wait()} before ready:\n{self.logs()}")
            self.seen.append(line)
            if self.ready_marker in line:
                self.ready_line = line
                return line

    @staticmethod
    def _read(proc: subprocess.Popen[str], lines: queue.SimpleQueue[str | None]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    def output(self) -> str:
        return "\n".join(self.seen)

    def logs(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            os.killpg(self.pid, signal.SIGKILL)
            assert self.proc is not None
            self.proc.wait()

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.alive():
            self.proc.send_signal(signal.SIGINT)
            try:  # generous: a fresh clone's first minutes compile every module on every core
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode


def serve_port(num_instances: int = 1) -> int:
    """A free port p such that p+1..p+num_instances-1 and their derived event ports (+10000,
    +20000, see kvconnect.commands.startup) are free too, from this xdist worker's share of
    `SERVE_BASES`."""

    def ports_of(port: int) -> list[int]:
        bases = range(port, port + num_instances)
        return [p + offset for p in bases for offset in (0, 10000, 20000)]

    return pick_port(worker_ports(SERVE_BASES, num_instances), ports_of)


class Serve(Process):
    """`kvconnect serve --model tiny` with KV events on (addresses derived from its port)."""

    def __init__(
        self, tmp: Path, *extra: str, model: str = "tiny", peer_port: int | None = None
    ) -> None:
        """`peer_port`: the port its peer tier serves on (in `extra`'s connector config),
        named to the router (`instance`)."""
        self.tmp, self.extra, self.model, self.peer_port = tmp, extra, model, peer_port
        self.new_ports()
        super().__init__(self.args, self.log)

    def new_ports(self) -> None:
        self.port = serve_port()
        self.args = [
            "serve",
            "--model",
            self.model,
            "--port",
            str(self.port),
            "--kv-events-config",
            json.dumps({"enable_kv_cache_events": True}),
            *self.extra,
        ]
        self.log = self.tmp / f"serve-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def instance(self) -> str:
        """This instance as `kvconnect router --instance` takes it."""
        spec = f"{self.url},tcp://127.0.0.1:{self.port + 10000},tcp://127.0.0.1:{self.port + 20000}"
        return spec if self.peer_port is None else f"{spec},peer=127.0.0.1:{self.peer_port}"


class RouterProcess(Process):
    def __init__(self, tmp: Path, instances: list[Serve], *extra: str) -> None:
        self.tmp, self.instances, self.extra = tmp, instances, extra
        self.new_ports()
        super().__init__([], self.log)

    def new_ports(self) -> None:
        self.port = free_port()
        self.log = self.tmp / f"router-{self.port}.log"

    def command(self) -> list[str]:
        """Built at each start: it names the instances' addresses as they are then (an
        instance that found a port taken moved)."""
        args = ["router", "--model", "tiny", "--port", str(self.port)]
        for s in self.instances:
            args += ["--instance", s.instance]
        return [*args, *self.extra]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def get(url: str, timeout: float = 10.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body = resp.read()
            status = resp.status
    except urllib.error.HTTPError as e:
        body, status = e.read(), e.code
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode(errors="replace")


def post(url: str, body: bytes | dict[str, Any], timeout: float = 60.0) -> tuple[int, Any, Any]:
    return request(url, body, timeout=timeout)


def request(
    url: str,
    body: bytes | dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> tuple[int, Any, Any]:
    """A GET (no `body`) or a POST of JSON: the status, the answer's JSON (its text if it is
    not JSON) and its headers, whatever the status."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    head = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=data, headers=head)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw, status, headers = resp.read(), resp.status, resp.headers
    except urllib.error.HTTPError as e:
        raw, status, headers = e.read(), e.code, e.headers
    try:
        return status, json.loads(raw), headers
    except ValueError:
        return status, raw.decode(errors="replace"), headers


@contextmanager
def serve_behind_router(tmp: Path, *serve_args: str) -> Iterator[tuple[Serve, RouterProcess]]:
    """One `kvconnect serve` and a router in front of it, for a module's tests; on the way out
    the router stops, then serve, which must exit cleanly (Ctrl-C: status 0)."""
    server = Serve(tmp, *serve_args)
    server.start()
    router = RouterProcess(tmp, [server])
    try:
        router.start()
        yield server, router
    finally:
        router.stop()
        assert server.stop() == 0, server.logs()


@contextmanager
def serving(servers: list[Serve]) -> Iterator[list[Serve]]:
    """`servers` started, for a module's tests; on the way out each one still running must
    exit cleanly (Ctrl-C: status 0)."""
    try:
        for s in servers:
            s.start()
        yield servers
    finally:
        for s in servers:
            if s.proc is not None:
                assert s.stop() == 0, s.logs()
