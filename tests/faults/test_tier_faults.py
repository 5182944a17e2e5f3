"""The engine with its offload tiers under failure: Redis killed, paused and restarted at the
moment loads read from it, disk chunks corrupted under a running engine, a full filesystem, a
CPU budget below one chunk. Every request completes with the output of a run without the
connector, and afterwards the tiers' events match what the tiers hold."""

from __future__ import annotations

import os
import random
import signal
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from kvconnect import LLM, SamplingParams
from kvconnect.commands.redis_server import LocalRedis
from kvconnect.connector.offload.tiers.disk import SUFFIX, DiskTier
from kvconnect.events import (
    TIER_CPU,
    TIER_STORAGE_LOCAL,
    TIER_STORAGE_REMOTE,
    BlockRemoved,
    BlockStored,
)
from tests.conftest import start_redis
from tests.connector.offload.test_redis_removals import Instance, in_tier, redis_blocks
from tests.helpers import RedisMonitor, wait_for

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
rng = random.Random(13)
SYSTEM = [rng.randrange(256) for _ in range(96)]  # 3 chunks of 32 shared by every prompt
PROMPTS = [SYSTEM + [rng.randrange(256) for _ in range(100 + i)] for i in range(6)]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    with LLM("tiny") as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def held(inst: Instance, tier: str) -> Counter[Any]:
    """What the published events say `tier` ("STORAGE/LOCAL", ...) holds, per block hash."""
    counts: Counter[Any] = Counter()
    for ev in inst.events:
        if isinstance(ev, BlockStored) and in_tier(ev, tier):
            counts.update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved) and in_tier(ev, tier):
            counts.subtract(ev.block_hashes)
    return +counts


def run_round(inst: Instance, reference: list[list[int]]) -> int:
    """The engine's own cache reset, then every prompt: outputs must be the reference. Waits
    until the round's stores are published. Returns the tokens loaded from the connector."""
    assert inst.llm.reset_prefix_cache() is True
    outs = inst.llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    scheduler = inst.llm.connector.scheduler  # type: ignore[union-attr]
    inst.until(lambda: not scheduler.has_pending_work())
    inst.llm.scheduler.check_integrity()
    pool = inst.llm.scheduler.pool
    assert pool.num_free_blocks == pool.num_blocks  # nothing leaked
    return sum(o.num_external_tokens for o in outs)


def when_gets_reach(server: LocalRedis, n: int, action: Callable[[], None]) -> threading.Event:
    """Run `action` as soon as the server has run `n` GETs (the loads' reads) from now on;
    the event is set once it has."""
    monitor = RedisMonitor([server.port])
    fired = threading.Event()

    def watch() -> None:
        try:
            if monitor.wait("get", n, timeout=60):
                action()
                fired.set()
        finally:
            monitor.close()

    threading.Thread(target=watch, daemon=True).start()
    return fired


def connector_stat(inst: Instance, name: str) -> int:
    stats = inst.llm.scheduler.connector_stats
    return 0 if stats is None else int(stats.data.get(name, 0))


def load_errors(inst: Instance) -> int:
    return connector_stat(inst, "num_load_errors")


@pytest.mark.parametrize("fault", ["killed", "paused", "restarted"])
def test_redis_failing_while_loads_read_it_changes_no_output(
    tmp_path: Path, reference: list[list[int]], fault: str
) -> None:
    server = start_redis()
    # short socket timeouts (the URL's override the tier's 2 s): a paused server costs less
    url = f"{server.url}?socket_timeout=0.5&socket_connect_timeout=0.5"
    inst = Instance(tmp_path, {"kind": "redis", "url": url})
    replacement: list[LocalRedis] = []
    try:
        assert run_round(inst, reference) == 0  # everything stored
        assert held(inst, TIER_STORAGE_REMOTE)
        pid = server.proc.pid

        def act() -> None:
            if fault == "killed":
                os.kill(pid, signal.SIGKILL)
            elif fault == "paused":
                os.kill(pid, signal.SIGSTOP)
            else:
                os.kill(pid, signal.SIGKILL)
                server.proc.wait()
                replacement.append(LocalRedis(port=server.port))  # empty, same address

        fired = when_gets_reach(server, 3, act)  # mid-round: some loads done, some not
        run_round(inst, reference)
        assert fired.wait(10), "the fault never fired"
        assert load_errors(inst) >= 1  # it did hit loads in flight
        if fault != "restarted":  # a server that stays away: the tier backs off, misses fast
            assert connector_stat(inst, "num_redis_fast_failures") >= 1
        if fault == "paused":
            os.kill(pid, signal.SIGCONT)
            # Back: once the tiers' back-off lets a probe through, loads work again.
            wait_for(lambda: run_round(inst, reference) > 0, 30, what="redis never used again")
        elif fault == "restarted":
            # The watcher resyncs on reconnect: what the new server lacks is announced gone,
            # what the rounds stored again is announced anew (once a round loads, they have).
            wait_for(lambda: run_round(inst, reference) > 0, 30, what="redis never used again")
            client = redis.Redis(port=server.port)
            inst.until(lambda: set(held(inst, TIER_STORAGE_REMOTE)) == redis_blocks(client))
            assert redis_blocks(client)
        else:
            run_round(inst, reference)  # still no Redis: recompute, same output
    finally:
        inst.close()
        if fault == "paused":
            os.kill(server.proc.pid, signal.SIGCONT)
        server.stop()
        for r in replacement:
            r.stop()


def rank_dir(root: Path) -> Path:
    """The one rank's directory of the one model under a disk tier's `path`."""
    [found] = root.glob("model-*/tp1-rank0")
    return found


def disk_contents(root: Path) -> Counter[Any]:
    """What the disk tier's directory holds, read by a fresh tier (as a restart would)."""
    counts: Counter[Any] = Counter()
    with DiskTier(str(rank_dir(root)), 1 << 34) as tier:
        for _, info in tier.entries():
            counts.update(info.block_hashes)
    return counts


def test_disk_chunks_corrupted_under_a_running_engine_are_dropped_and_recomputed(
    tmp_path: Path, reference: list[list[int]]
) -> None:
    root = tmp_path / "disk"
    inst = Instance(tmp_path, {"kind": "disk", "path": str(root), "max_bytes": 1 << 28})
    try:
        run_round(inst, reference)
        files = sorted(rank_dir(root).glob("*" + SUFFIX))
        assert len(files) == 3 + 6 * 3  # the shared chunks once, then each prompt's own
        for i, f in enumerate(files):  # one flipped payload byte in every other file
            if i % 2 == 0:
                blob = bytearray(f.read_bytes())
                blob[-1 - i] ^= 0x10
                f.write_bytes(blob)
        run_round(inst, reference)
        assert load_errors(inst) >= 1
        removed = sum(
            isinstance(e, BlockRemoved) and in_tier(e, TIER_STORAGE_LOCAL) for e in inst.events
        )
        assert removed >= 1  # each bad chunk is announced gone
        run_round(inst, reference)
    finally:
        inst.close()
    assert held(inst, TIER_STORAGE_LOCAL) == disk_contents(root)


def test_a_full_disk_changes_no_output_and_the_events_say_what_it_holds(
    tmp_path: Path, small_fs: Path, reference: list[list[int]]
) -> None:
    """A 1 MiB filesystem holds about 7 of the 21 chunks (128 KiB each); the tier's budget
    (1 GiB) is not what stops it: writes fail with ENOSPC."""
    root = small_fs / "disk"
    inst = Instance(tmp_path, {"kind": "disk", "path": str(root), "max_bytes": 1 << 30})
    try:
        run_round(inst, reference)
        stats = inst.llm.scheduler.connector_stats
        assert stats is not None and stats.data.get("num_disk_errors", 0) >= 1
        run_round(inst, reference)
    finally:
        inst.close()
    assert held(inst, TIER_STORAGE_LOCAL) == disk_contents(root)
    assert 0 < len(held(inst, TIER_STORAGE_LOCAL)) < 21 * 2


def test_a_cpu_budget_below_one_chunk_runs_without_that_tier(
    tmp_path: Path, reference: list[list[int]]
) -> None:
    inst = Instance(tmp_path, {"kind": "cpu", "max_bytes": 1000})
    try:
        assert run_round(inst, reference) == 0
        assert run_round(inst, reference) == 0  # nothing stored, nothing loaded
        assert not held(inst, TIER_CPU)
    finally:
        inst.close()
