"""kvconnect's OffloadConnector under vLLM 0.33's real Scheduler and KVCacheManager (see
harness.py): external hits and their asynchronous loads, a failed load recomputed, preemption,
a request finished with its stores or its load still running, reset_prefix_cache, two TP
ranks' events folded by vLLM's KVOutputAggregator and released once, and vLLM's MultiConnector
with kvconnect's connector beside vLLM's ExampleConnector.

Prompts are 100 tokens, blocks 16, chunks 32: three chunks (96 tokens) can be loaded, the last
4 tokens are always computed.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from kvconnect.events import BlockRemoved, BlockStored, KVCacheEvent
from tests_vllm.v033.harness import (
    BLOCK,
    Engine,
    Events,
    StepResult,
    cpu_tier,
    engine,
    transfer,
)

PROMPT, CHUNK = 100, 32
LOADABLE = (PROMPT - 1) // CHUNK * CHUNK  # 96


def prompt(seed: int, n: int = PROMPT) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


def stored(events: list[KVCacheEvent]) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]


def removed(events: list[KVCacheEvent]) -> list[BlockRemoved]:
    return [e for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU"]


def scheduled(request_id: str) -> Any:
    return lambda r: request_id in r.output.num_scheduled_tokens


def external(steps: list[StepResult], request_id: str) -> int:
    """Tokens vLLM counted as loaded by the connector for the request's prefill."""
    stats = [s.prefill_stats(request_id) for s in steps]
    found = [s for s in stats if s is not None]
    assert len(found) == 1, stats
    return int(found[0].num_external_cached_tokens)


def assert_no_leak(eng: Engine) -> None:
    """vLLM's own emptiness checks (as its connector tests make them): no request left, every
    block back in the free queue with no reference."""
    s = eng.scheduler
    assert not s.requests and not s.running and not s.waiting
    assert not s.finished_recving_kv_req_ids and not s.failed_recving_kv_req_ids
    pool = s.kv_cache_manager.block_pool
    assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    manager = s.kv_cache_manager.coordinator.single_type_managers[0]
    assert not manager.req_to_blocks


def run_and_store(eng: Engine, events: Events, request_id: str, tokens: list[int]) -> None:
    """Run a request to its end and wait until its chunks' stores are announced."""
    before = len(stored(events.snapshot()))
    eng.add(request_id, tokens)
    eng.finish(request_id)
    eng.settle()
    events.wait_for(lambda ev: len(stored(ev)) >= before + LOADABLE // CHUNK)


def load_again(eng: Engine, request_id: str, tokens: list[int]) -> list[StepResult]:
    """The prompt again after vLLM's own cache was emptied: steps until it is scheduled."""
    assert eng.scheduler.reset_prefix_cache()
    eng.add(request_id, tokens)
    first = eng.step()
    assert request_id not in first.output.num_scheduled_tokens
    assert eng.status(request_id) == RequestStatus.WAITING_FOR_REMOTE_KVS
    return [first, *eng.run_until(scheduled(request_id))]


def test_external_hit_loads_asynchronously(model_dir: Path, tmp_path: Path) -> None:
    tokens = prompt(1)
    with engine(model_dir, transfer(cpu_tier()), tmp_path) as (eng, events):
        run_and_store(eng, events, "a", tokens)
        chunks = stored(events.snapshot())
        hashes = [h for e in chunks for h in e.block_hashes]
        assert len(chunks) == LOADABLE // CHUNK and len(set(hashes)) == LOADABLE // BLOCK
        steps = load_again(eng, "b", tokens)
        # The step that schedules b computes only what was not loaded; its forward read the
        # loaded context first (harness: Engine._forward), so the blocks hold a's KV.
        assert steps[-1].output.num_scheduled_tokens["b"] == PROMPT - LOADABLE
        assert sum("b" in s.finished_recving for s in steps) == 1
        steps += eng.finish("b")
        assert external(steps, "b") == LOADABLE
        eng.settle()
        assert len(stored(events.snapshot())) == len(chunks)  # nothing stored twice
        assert_no_leak(eng)


def hits_by_source(steps: list[StepResult]) -> dict[str, int]:
    """What vLLM 0.33's scheduler recorded of the connector's hits, by source, over `steps`
    (what it counts in `vllm:prompt_tokens_cached_by_source`)."""
    found: dict[str, int] = {}
    for step in steps:
        for stats in step.scheduler_stats:
            connector = stats.connector_prefix_cache_stats
            for source, n in (connector.hits_by_source if connector else {}).items():
                found[source.value] = found.get(source.value, 0) + n
    return found


def test_hits_are_credited_to_the_tier_that_supplied_them(model_dir: Path, tmp_path: Path) -> None:
    """vLLM 0.33 asks `get_external_cache_hit_sources` after the load is planned: chunks from
    the cpu tier are host, those a disk tier holds alone disk (vLLM's default credited every
    hit to one source)."""
    extra = cpu_tier(CHUNK, max_chunks=2)
    extra["tiers"].append({"kind": "disk", "path": str(tmp_path / "disk")})
    tokens = prompt(1)
    with engine(model_dir, transfer(extra), tmp_path) as (eng, events):
        run_and_store(eng, events, "a", tokens)  # its last 2 chunks in cpu, the rest on disk
        steps = load_again(eng, "b", tokens)
        steps += eng.finish("b")
        assert external(steps, "b") == LOADABLE
        by_source = hits_by_source(steps)
        assert by_source == {"host": 2 * CHUNK, "disk": LOADABLE - 2 * CHUNK}, by_source
        eng.settle()
        assert_no_leak(eng)


def test_the_last_chunk_loads_in_part(model_dir: Path, tmp_path: Path) -> None:
    """128 tokens: the hit ends on the last whole block before the last token, as vLLM's own
    prefix cache ends it (112 tokens: chunks 0-2 and chunk 3's first block), not at 96."""
    tokens = prompt(10, 128)
    with engine(model_dir, transfer(cpu_tier()), tmp_path) as (eng, events):
        eng.add("a", tokens)
        eng.finish("a")
        eng.settle()
        events.wait_for(lambda ev: len(stored(ev)) == 4)
        steps = load_again(eng, "b", tokens)
        assert steps[-1].output.num_scheduled_tokens["b"] == 128 - 112
        steps += eng.finish("b")
        assert external(steps, "b") == 112
        eng.settle()
        assert_no_leak(eng)


def test_a_load_done_during_the_forward_runs_in_the_next_step(
    model_dir: Path, tmp_path: Path
) -> None:
    """With other requests running, the step that hands a load to the workers has a forward;
    the load starts before it, so a load done by the forward's end is reported in that step
    and its request computes in the next (vLLM starts async loads after the forward: it
    would be reported a step later)."""
    tokens = prompt(11)
    with engine(model_dir, transfer(cpu_tier()), tmp_path, slow_forward=True) as (eng, events):
        run_and_store(eng, events, "a", tokens)
        assert eng.scheduler.reset_prefix_cache()
        eng.add("busy", prompt(12), max_tokens=40)
        eng.run_until(lambda _: eng.scheduler.requests["busy"].num_output_tokens > 0)
        eng.add("b", tokens)
        handed = eng.step()
        assert handed.output.num_scheduled_tokens == {"busy": 1}
        assert handed.finished_recving == {"b"}
        assert eng.step().output.num_scheduled_tokens == {"busy": 1, "b": PROMPT - LOADABLE}
        eng.finish("b")
        eng.finish("busy")
        eng.settle()
        assert_no_leak(eng)


def test_an_idle_step_waits_for_its_load(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that computes nothing (vLLM only waits for the load) waits in the worker for the
    load instead of returning at once, so vLLM's loop does not spin against the I/O thread;
    with the wait made long, the load is reported by the very step that handed it over."""
    monkeypatch.setattr("kvconnect.vllm.connector.IDLE_LOAD_WAIT_S", 60.0)
    tokens = prompt(13)
    with engine(model_dir, transfer(cpu_tier()), tmp_path) as (eng, events):
        run_and_store(eng, events, "a", tokens)
        assert eng.scheduler.reset_prefix_cache()
        eng.add("b", tokens)
        handed = eng.step()
        assert handed.output.total_num_scheduled_tokens == 0
        assert handed.finished_recving == {"b"}
        assert eng.step().output.num_scheduled_tokens == {"b": PROMPT - LOADABLE}
        eng.finish("b")
        eng.settle()
        assert_no_leak(eng)


def test_failed_load_is_recomputed(model_dir: Path, tmp_path: Path) -> None:
    tokens = prompt(2)
    with engine(model_dir, transfer(cpu_tier()), tmp_path) as (eng, events):
        run_and_store(eng, events, "a", tokens)
        # The middle chunk disappears from the tier behind the scheduler's back.
        tier = eng.ranks[0].connector.worker.tiers[0]
        key = next(k for k, info in tier.entries() if list(info.token_ids) == tokens[32:64])
        assert tier.remove(key) is not None
        steps = load_again(eng, "b", tokens)
        blocks = eng.block_ids("b")
        failed = set().union(*(s.invalid_block_ids for s in steps))
        assert failed == set(blocks[2:4])  # chunk 1's blocks
        # vLLM recomputes from the first failed block; chunk 0's load is kept.
        assert steps[-1].output.num_scheduled_tokens["b"] == 64  # the token budget
        assert eng.scheduler.requests["b"].num_computed_tokens == 32 + 64
        eng.finish("b")
        eng.settle()
        assert_no_leak(eng)


def test_preempted_request_resumes_with_its_kv(model_dir: Path, tmp_path: Path) -> None:
    # 15 usable blocks: two 100-token prompts (7 blocks each) cannot both decode 60 tokens.
    with engine(model_dir, transfer(cpu_tier()), tmp_path, num_blocks=16) as (eng, _):
        eng.add("a", prompt(3), max_tokens=60)
        eng.add("b", prompt(4), max_tokens=60)
        steps = eng.run_until(lambda _: not eng.scheduler.requests, max_steps=800)
        preempted = set().union(*(s.output.preempted_req_ids or set() for s in steps))
        assert preempted == {"b"}
        # Resumed, b re-read its prompt and output KV (local or loaded): every forward
        # checked it.
        eng.settle()
        assert_no_leak(eng)


def test_finished_with_stores_in_flight(model_dir: Path, tmp_path: Path) -> None:
    tokens = prompt(5)
    with engine(model_dir, transfer(cpu_tier()), tmp_path) as (eng, events):
        eng.add("a", tokens)
        eng.step()  # 64 tokens computed: chunks 0 and 1 copied out and queued
        eng.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
        # The connector asked for no delay: a's blocks are free at once.
        assert "a" not in eng.scheduler.requests
        eng.settle()
        events.wait_for(lambda ev: len(stored(ev)) == 2)
        assert [e.token_ids for e in stored(events.snapshot())] == [tokens[:32], tokens[32:64]]
        assert_no_leak(eng)


def test_finished_with_load_in_flight(model_dir: Path, tmp_path: Path) -> None:
    tokens = prompt(6)
    with engine(model_dir, transfer(cpu_tier()), tmp_path) as (eng, events):
        run_and_store(eng, events, "a", tokens)
        assert eng.scheduler.reset_prefix_cache()
        eng.add("b", tokens)
        eng.step()  # the load is handed to the workers
        loading = "b" in eng.scheduler.connector._loading
        eng.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
        # While the workers may still write into b's blocks, vLLM keeps them.
        assert ("b" in eng.scheduler.requests) == loading
        eng.run_until(lambda _: "b" not in eng.scheduler.requests)
        eng.settle()
        assert_no_leak(eng)


def test_reset_prefix_cache_empties_the_tiers(model_dir: Path, tmp_path: Path) -> None:
    tokens = prompt(7)
    with engine(model_dir, transfer(cpu_tier()), tmp_path) as (eng, events):
        run_and_store(eng, events, "a", tokens)
        assert eng.scheduler.reset_prefix_cache(reset_connector=True)
        eng.settle()
        events.wait_for(lambda ev: len(removed(ev)) == LOADABLE // CHUNK)
        got = removed(events.snapshot())
        assert sorted(h for e in got for h in e.block_hashes) == sorted(
            h for e in stored(events.snapshot()) for h in e.block_hashes
        )
        eng.add("b", tokens)
        first = eng.step()  # no hit anywhere: computed from the start
        assert first.output.num_scheduled_tokens["b"] == 64
        assert external([first, *eng.finish("b")], "b") == 0
        eng.settle()
        assert_no_leak(eng)


def test_two_ranks_events_released_once(model_dir: Path, tmp_path: Path) -> None:
    tokens = prompt(8)
    with engine(model_dir, transfer(cpu_tier()), tmp_path, tp=2) as (eng, events):
        run_and_store(eng, events, "a", tokens)
        chunks = stored(events.snapshot())
        assert [e.token_ids for e in chunks] == [tokens[i : i + 32] for i in (0, 32, 64)]
        # Both ranks loaded (vLLM's aggregator waits for both before finished_recving).
        steps = load_again(eng, "b", tokens)
        assert steps[-1].output.num_scheduled_tokens["b"] == PROMPT - LOADABLE
        eng.finish("b")
        eng.settle()
        assert len(stored(events.snapshot())) == 3
        for rank in eng.ranks:
            assert rank.connector.worker.drain()
            assert len(list(rank.connector.worker.tiers[0].entries())) == 3
        assert_no_leak(eng)


def test_multi_connector_beside_example_connector(model_dir: Path, tmp_path: Path) -> None:
    tokens = prompt(9)
    example = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "example")},
    }
    multi = {
        "kv_connector": "MultiConnector",
        "kv_connector_extra_config": {"connectors": [transfer(cpu_tier()), example]},
    }
    multi["kv_role"] = "kv_both"
    with engine(model_dir, multi, tmp_path) as (eng, events):
        run_and_store(eng, events, "a", tokens)
        assert len(stored(events.snapshot())) == 3
        steps = load_again(eng, "b", tokens)
        assert steps[-1].output.num_scheduled_tokens["b"] == PROMPT - LOADABLE
        eng.finish("b")
        assert eng.scheduler.reset_prefix_cache(reset_connector=True)
        eng.settle()
        events.wait_for(lambda ev: len(removed(ev)) == 3)
        assert len(stored(events.snapshot())) == 3
        assert_no_leak(eng)


@pytest.fixture(autouse=True)
def _short_ipc_path(tmp_path: Path) -> None:
    # ipc:// paths are limited to ~107 bytes; pytest's tmp paths stay well under that here.
    assert len(str(tmp_path)) < 90, tmp_path
