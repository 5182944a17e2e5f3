"""Fixtures shared by the whole suite: a real redis-server on a free loopback port. And how
the suite splits over pytest-xdist workers (`make test` runs `-n auto --dist loadgroup`): the
tests of a module that share a module-scoped fixture (a `kvconnect serve` cluster, a loaded
model) go to one worker, so that it is set up once; every other test goes where there is room."""

from __future__ import annotations

import os

# OpenMP threads with nothing to do sleep instead of spinning. The suite runs engines, their
# worker processes and `kvconnect serve` processes side by side on xdist workers, more compute
# threads than cores, and spinning threads take the cores the others wait for. Measured on two
# busy cores, 60 tiny-model generate() calls in one process: 23-31 s of CPU and 60-84 s with
# spinning threads, 5-6 s of CPU and 15 s with sleeping ones. Set before torch is imported
# (libgomp reads it when it loads); every process the tests start inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import shutil
from collections.abc import Iterator

import pytest

from kvconnect.commands.redis_server import LocalRedis
from tests.helpers import free_port


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else []
        if any(d and d[-1].scope in ("module", "class") for d in defs):
            item.add_marker(pytest.mark.xdist_group(_module(item)))
    if "PYTEST_XDIST_WORKER" in os.environ:
        # Modules with slow or fault tests (processes, models) first, each in one piece and in
        # its own order: what is left for the end is short, so the workers finish together.
        heavy = {
            _module(item)
            for item in items
            if item.get_closest_marker("slow") or _module(item).startswith("tests/faults/")
        }
        items.sort(key=lambda item: _module(item) not in heavy)


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def start_redis() -> LocalRedis:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed; `make test` installs it (apt-get)")
    # A port of this xdist worker's own: LocalRedis's own choice (the kernel's) could be the
    # one another worker's server is about to bind, and its readiness PING would then be
    # answered by that other server.
    return LocalRedis(port=free_port())


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
