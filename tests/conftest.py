"""Fixtures shared by the whole suite: a real redis-server on a free loopback port."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.helpers import free_port


@dataclass
class RedisServer:
    port: int
    proc: subprocess.Popen[bytes]
    workdir: str

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    def flush(self) -> None:
        import redis

        redis.Redis(port=self.port).flushall()


def start_redis() -> RedisServer:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed; `make test` installs it (apt-get)")
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="kvconnect-redis-")
    proc = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    import redis

    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            if client.ping():
                return RedisServer(port, proc, workdir)
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    pytest.fail("redis-server did not start")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = start_redis()
    yield server
    server.stop()
    shutil.rmtree(server.workdir, ignore_errors=True)


@pytest.fixture
def fresh_redis(redis_server: RedisServer) -> RedisServer:
    redis_server.flush()
    return redis_server
