"""Fixtures shared by the whole suite (a real redis-server on a free loopback port) and how the
suite splits over pytest-xdist workers.

`make test` runs `pytest -n auto --dist loadgroup`, and `pytest_xdist_make_scheduler` below
gives that its meaning here:

    unit of work   the tests of a module that share a module-scoped fixture (a `kvconnect
                   serve` cluster, a loaded model) are one, run by one worker, so the fixture is
                   set up once; an `xdist_group` mark makes one too; any other test is its own
    order          units marked `alone` or `solo` first, then those of modules with slow or
                   fault tests (processes, models), then the rest: what is left for the end is
                   short, so the workers finish together
    solo           while a unit marked `solo` runs on one worker, the others run only tests
                   of the rest (no processes, no models): its deadlines time the processes
                   under test, not a machine that is busy with others
    alone          a unit marked `alone` runs with every other worker idle: it keeps both
                   cores busy itself, and tests beside it (even ones that start no process)
                   would time a starved machine. They run first: later, another worker always
                   holds a unit (a worker runs its last test only once it has the next one),
                   so they would wait for ever

The units are decided where fixtures are known, on the workers at collection, and reach the
scheduler (in the controlling process) through a file: xdist 3.8's own loadgroup marks its
units by rewriting node ids, which pytest 9.2 no longer lets it do (pytest-xdist issue 1386),
and then it silently runs every test as a unit of its own.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
from pathlib import Path
from typing import Any

# OpenMP threads with nothing to do sleep instead of spinning. The suite runs engines, their
# worker processes and `kvconnect serve` processes side by side on xdist workers, more compute
# threads than cores, and spinning threads take the cores the others wait for. Measured on two
# busy cores, 60 tiny-model generate() calls in one process: 23-31 s of CPU and 60-84 s with
# spinning threads, 5-6 s of CPU and 15 s with sleeping ones. Set before torch is imported
# (libgomp reads it when it loads); every process the tests start inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# A suite started in the background of a non-interactive shell (`make test &`) inherits SIGINT
# ignored, and so would every process it starts: the tests that stop a CLI with Ctrl-C need it
# delivered (an ignored signal stays ignored across exec; a handled one is reset to default).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import shutil
from collections.abc import Iterator

import pytest

from kvconnect.commands.redis_server import LocalRedis
from tests.helpers import free_port

UNITS_DIR = "KVCONNECT_XDIST_UNITS"
"""Environment: the directory where each xdist worker writes what it collected (`_plan`)."""


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("dist", "no") != "no" and "PYTEST_XDIST_WORKER" not in os.environ:
        os.environ[UNITS_DIR] = tempfile.mkdtemp(prefix="kvconnect-xdist-")  # workers inherit


@pytest.hookimpl(trylast=True)  # after every other hook marked the items
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return
    heavy = {_module(item) for item in items if _heavy(item)}
    solo = {_module(item) for item in items if item.get_closest_marker("solo")}
    alone = {_module(item) for item in items if item.get_closest_marker("alone")}
    first = solo | alone
    # Stable: each module stays in one piece and in its own order.
    items.sort(key=lambda item: 0 if _module(item) in first else 1 if _module(item) in heavy else 2)
    plan = {
        "units": {item.nodeid: unit for item in items if (unit := _unit(item)) is not None},
        "heavy": [item.nodeid for item in items if _module(item) in heavy],
        "solo": [item.nodeid for item in items if _module(item) in solo],
        "alone": [item.nodeid for item in items if _module(item) in alone],
    }
    if UNITS_DIR in os.environ:
        path = Path(os.environ[UNITS_DIR]) / f"{worker}.json"
        path.with_suffix(".tmp").write_text(json.dumps(plan))
        path.with_suffix(".tmp").replace(path)


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def _heavy(item: pytest.Item) -> bool:
    return bool(item.get_closest_marker("slow")) or _module(item).startswith("tests/faults/")


def _unit(item: pytest.Item) -> str | None:
    """The unit of work `item` shares with other tests, if any."""
    marks = sorted(
        str(m.args[0] if m.args else m.kwargs.get("name", "default"))
        for m in item.iter_markers("xdist_group")
    )
    if marks:
        return "@" + "_".join(marks)
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else []
    if any(d and d[-1].scope in ("module", "class", "package") for d in defs):
        return _module(item)
    return None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):  # type: ignore[misc]
        """xdist's loadscope over the units the workers collected, in their collection order,
        with `solo` units kept apart from the other heavy ones (see the module docstring).
        Whole modules are the units if no worker wrote what it collected."""

        plan: dict[str, Any] | None = None
        heavy: set[str] = set()
        solo: set[str] = set()
        alone: set[str] = set()

        def schedule(self) -> None:
            if self.collection is None:  # the first call: every worker has collected
                found = sorted(Path(os.environ.get(UNITS_DIR, "/nonexistent")).glob("*.json"))
                if found:
                    self.plan = json.loads(found[0].read_text())
                    self.heavy = {self._split_scope(n) for n in self.plan["heavy"]}
                    self.solo = {self._split_scope(n) for n in self.plan["solo"]}
                    self.alone = {self._split_scope(n) for n in self.plan["alone"]}
                self.config.option.loadscopereorder = False
            super().schedule()

        def _split_scope(self, nodeid: str) -> str:
            if self.plan is None:
                return nodeid.split("::")[0]
            return str(self.plan["units"].get(nodeid, nodeid))

        def _allowed(self, scope: str, node: Any) -> bool:
            """Whether `node` may take `scope` now, given what the other nodes have yet to
            run (`node` runs its own tests one after another)."""
            others = {
                unit
                for other, work in self.assigned_work.items()
                if other is not node
                for unit, done in work.items()
                if not all(done.values())
            }
            if others & self.alone:
                return False
            if scope in self.alone:
                return not others
            if any(unit in self.alone for unit in self.workqueue):
                return False  # the alone units first, while nothing else is running
            if others & self.solo:
                return scope not in self.heavy and scope not in self.solo
            if scope in self.solo:
                return not others & (self.heavy | self.solo)
            return True

        def _assign_work_unit(self, node: Any) -> None:
            """The first units `node` may take now, until it holds two tests, if any (else it
            waits: every completed test reschedules every node). Two: a worker runs a test
            only once it holds the next (pytest's `nextitem`), so a worker given one test of
            one unit sat idle until some other test ended (15-20 s behind a fuzz test)."""
            assigned = self.assigned_work.setdefault(node, {})
            while self._pending_of(assigned) < 2:
                scope = next((u for u in self.workqueue if self._allowed(u, node)), None)
                if scope is None:
                    return
                assigned[scope] = work = self.workqueue.pop(scope)
                collection = self.registered_collections[node]
                node.send_runtest_some(
                    [collection.index(n) for n, done in work.items() if not done]
                )

        def mark_test_complete(self, node: Any, item_index: int, duration: float = 0) -> None:
            super().mark_test_complete(node, item_index, duration)
            for other in self.nodes:  # one that waited may go on now
                if other is not node:
                    self._reschedule(other)

    return UnitScheduling(config, log)


def pytest_unconfigure(config: pytest.Config) -> None:
    if "PYTEST_XDIST_WORKER" not in os.environ and UNITS_DIR in os.environ:
        shutil.rmtree(os.environ.pop(UNITS_DIR), ignore_errors=True)


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
