"""Fixtures shared by the whole suite: a real redis-server on a free loopback port."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from kvconnect.commands.redis_server import LocalRedis


def start_redis() -> LocalRedis:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed; `make test` installs it (apt-get)")
    return LocalRedis()


def flush(server: LocalRedis) -> None:
    import redis

    redis.Redis(port=server.port).flushall()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[LocalRedis]:
    server = start_redis()
    yield server
    server.stop()


@pytest.fixture
def fresh_redis(redis_server: LocalRedis) -> LocalRedis:
    flush(redis_server)
    return redis_server
