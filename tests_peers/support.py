"""What every part of the peer suite uses: the test model's numbers, prompts, waits, free
ports, HTTP (also over a Unix socket) and child processes.

Every wait is on a condition (an event seen, a log line, a counter), bounded by a deadline
that fails the test with what was last seen.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from http.client import HTTPConnection
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.helpers import pick_port

MODEL = "tiny"
VOCAB = 258  # the tiny model's byte vocabulary
BLOCK_SIZE = 16
WAIT = 30.0
"""Deadline of every wait; on this 2-core machine each takes well under a second."""

T = TypeVar("T")


def prompt(tag: str, num_tokens: int = 80) -> list[int]:
    """Token ids no other test uses: seeded by `tag`."""
    rng = random.Random(tag)
    return [rng.randrange(VOCAB) for _ in range(num_tokens)]


def wait_for(
    what: str,
    check: Callable[[], T | None],
    timeout: float = WAIT,
    detail: Callable[[], str] = lambda: "",
) -> T:
    """`check()`'s first value that is not None, asked every 20 ms; fails after `timeout`
    with `what` and `detail()`."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{detail()}")
        time.sleep(0.02)


# -- ports and HTTP ----------------------------------------------------------------------------


def free_port(offsets: tuple[int, ...] = (0,)) -> int:
    """A port p with p + each offset free on 127.0.0.1 now and not handed out before (the
    unit suite's chooser). p is taken from 3000-9999, so p + 20000 is still below the
    kernel's ephemeral range (32768-60999) and no outgoing connection holds one by chance."""
    return pick_port(list(range(3000, 10000)), lambda p: [p + o for o in offsets])


class _UnixHTTPConnection(HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = str(path)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def http(
    url: str, body: Any = None, *, unix: Path | None = None, timeout: float = 60.0
) -> tuple[int, Any]:
    """(status, JSON body or text) of a GET (`body` None) or a JSON POST to `url`; through the
    Unix socket `unix` when given (then `url` is only the path)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    method = "GET" if body is None else "POST"
    if unix is not None:
        conn = _UnixHTTPConnection(unix, timeout)
        try:
            conn.request(method, url, data, headers)
            resp = conn.getresponse()
            status, raw = resp.status, resp.read()
        finally:
            conn.close()
    else:
        req = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
    text = raw.decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def completion(tokens: list[int], **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": tokens, "max_tokens": 1, **fields}


# -- processes ---------------------------------------------------------------------------------


@dataclass
class Proc:
    """A child process in a process group of its own, its output in `log`."""

    popen: subprocess.Popen[bytes]
    log: Path

    @classmethod
    def start(cls, cmd: list[str], log: Path, **kw: Any) -> Proc:
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **kw
            )
        return cls(popen, log)

    def tail(self, num_chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-num_chars:] if self.log.exists() else ""

    def check_running(self, what: str) -> None:
        if self.popen.poll() is not None:
            pytest.fail(f"{what} exited {self.popen.returncode}:\n{self.tail()}")

    def stop(self) -> None:
        """SIGTERM to its group (every process it started), SIGKILL after 10 s."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()


def wait_http(url: str, proc: Proc, what: str, unix: Path | None = None) -> None:
    def up() -> bool | None:
        proc.check_running(what)
        try:
            return True if http(url, unix=unix, timeout=2)[0] == 200 else None
        except OSError:
            return None

    wait_for(f"{what} to answer {url}", up, timeout=120)
