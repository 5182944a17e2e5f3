"""The offload connector inside the real engine: worker processes, real tiers, real redis."""

import json
import logging
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvconnect import LLM, SamplingParams
from kvconnect.commands.redis_server import LocalRedis
from kvconnect.connector.multi import MultiConnector
from kvconnect.connector.offload.connector import OffloadConnector
from kvconnect.connector.offload.tiers.disk import SUFFIX
from kvconnect.events import BlockRemoved, BlockStored
from kvconnect.stream.subscriber import KVEventSubscriber
from tests.conftest import start_redis
from tests.connector.helpers import MODULE
from tests.helpers import read_through

pytestmark = pytest.mark.slow

CHUNK = 32
# 4 whole chunks + 22 tokens; finished (6 tokens more), a tail of one block is saved too
PROMPT = [random.Random(9).randrange(256) for _ in range(150)]
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def offload(*tiers: dict[str, Any]) -> dict[str, Any]:
    return {
        "kv_connector": "OffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"chunk_size": CHUNK, "tiers": list(tiers)},
    }


def step_until(llm: LLM, condition: Callable[[], bool], timeout: float = 30.0) -> None:
    """Step the engine (the workers' I/O threads report as steps go by) until `condition()`."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        llm.step()


def released(llm: LLM) -> int:
    """Connector events the scheduler has released (every rank reported them)."""
    assert isinstance(llm.connector, OffloadConnector) and llm.connector.scheduler is not None
    return llm.connector.scheduler.quorum.num_released


def settle(llm: LLM, num_events: int) -> None:
    """Wait until `num_events` connector events in all have reached the scheduler."""
    step_until(llm, lambda: released(llm) >= num_events)


def assert_no_leaks(llm: LLM) -> None:
    llm.scheduler.check_integrity()
    pool = llm.scheduler.pool
    assert pool.num_free_blocks == pool.num_blocks and not llm.scheduler.requests


def tier(kind: str, tmp: Path, redis: LocalRedis) -> dict[str, Any]:
    return {
        "cpu": {"kind": "cpu", "max_bytes": 1 << 26},
        "disk": {"kind": "disk", "path": str(tmp), "max_bytes": 1 << 28},
        "redis": {"kind": "redis", "url": redis.url},
    }[kind]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", ["cpu", "disk", "redis"])
def test_reset_then_the_same_prompt_loads_from_the_tier(
    tmp_path: Path, fresh_redis: LocalRedis, kind: str, tp: int
) -> None:
    with LLM(
        "tiny",
        tensor_parallel_size=tp,
        kv_transfer_config=offload(tier(kind, tmp_path, fresh_redis)),
    ) as llm:
        first = llm.generate([PROMPT], GREEDY)[0]
        assert first.num_external_tokens == 0
        # the 4 chunks are in the tier, and in a local one the tail the request left: its
        # 155 computed tokens' 9th block (a shared tier keeps whole chunks only)
        entries = 4 if kind == "redis" else 5
        settle(llm, entries)
        assert llm.reset_prefix_cache() is True  # the engine's own cache only
        again = llm.generate([PROMPT], GREEDY)[0]
        loaded = 4 * CHUNK if kind == "redis" else 4 * CHUNK + 16
        assert again.num_external_tokens == loaded and again.num_cached_tokens == 0
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        stats = llm.scheduler.connector_stats
        assert stats is not None and stats.data["num_chunks_loaded"] == entries * tp
        assert_no_leaks(llm)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_returning_turn_recomputes_only_its_new_tokens_and_the_block_they_start_in(
    tp: int,
) -> None:
    """A chat's second turn sends the first turn's prompt, its answer and a new message.
    The first turn, finished, saved what it computed past its whole chunks (the answer's
    chunk and the tail of fewer blocks), so the second turn, pushed out of the engine's own
    cache, loads all of it but the block its new tokens start in, with the same output."""
    answer = SamplingParams(max_tokens=40, ignore_eos=True)
    cfg = offload({"kind": "cpu", "max_bytes": 1 << 26})
    with LLM("tiny", tensor_parallel_size=tp, kv_transfer_config=cfg) as llm, LLM("tiny") as ref:
        first = llm.generate([PROMPT], answer)[0]
        history = PROMPT + list(first.outputs[0].token_ids)  # 190 tokens, 189 computed
        settle(llm, 6)  # chunks 0-3, then chunk 4 (tokens 128-159) and a tail (160-175)
        turn = history + [random.Random(5).randrange(256) for _ in range(12)]
        assert llm.reset_prefix_cache() is True
        second = llm.generate([turn], GREEDY)[0]
        assert second.outputs[0].token_ids == ref.generate([turn], GREEDY)[0].outputs[0].token_ids
        recomputed = len(turn) - second.num_external_tokens
        assert second.num_external_tokens == 176 and recomputed <= 12 + 16, recomputed
        settle(llm, 6 + 1)  # the second turn's chunk 5 (160-191); 207 computed: no tail
        assert_no_leaks(llm)
        assert isinstance(llm.connector, OffloadConnector) and llm.connector.scheduler
        assert not llm.connector.scheduler._holding


def test_a_second_instance_reuses_the_first_ones_kv_through_redis(
    fresh_redis: LocalRedis,
) -> None:
    cfg = offload({"kind": "redis", "url": fresh_redis.url})
    with LLM("tiny", tensor_parallel_size=2, kv_transfer_config=cfg) as first:
        expected = first.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
        settle(first, 4)
    with LLM("tiny", tensor_parallel_size=2, kv_transfer_config=cfg) as second:
        out = second.generate([PROMPT], GREEDY)[0]
        assert_no_leaks(second)
    assert out.num_external_tokens == 4 * CHUNK and out.outputs[0].token_ids == expected


def test_redis_stopped_mid_run_still_gives_correct_output(caplog: pytest.LogCaptureFixture) -> None:
    server = start_redis()
    try:
        with LLM("tiny", kv_transfer_config=offload({"kind": "redis", "url": server.url})) as llm:
            expected = llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
            settle(llm, 4)
            server.stop()
            llm.reset_prefix_cache()
            with caplog.at_level(logging.WARNING):
                out = llm.generate([PROMPT], GREEDY)[0]
            assert out.outputs[0].token_ids == expected and out.num_external_tokens == 0
            assert llm.connector is not None and llm.connector.scheduler is not None
            lookup = llm.connector.scheduler.lookup
            assert lookup is not None and lookup.num_errors >= 1
            assert "shared tier lookup failed" in caplog.text
            assert_no_leaks(llm)
    finally:
        server.stop()


def test_a_corrupted_disk_chunk_is_recomputed_and_reported(tmp_path: Path) -> None:
    with tempfile.TemporaryDirectory() as d:
        events = {"enable_kv_cache_events": True, "endpoint": f"ipc://{d}/ev"}
        cfg = offload({"kind": "disk", "path": str(tmp_path), "max_bytes": 1 << 28})
        with LLM("tiny", kv_transfer_config=cfg, kv_events_config=events) as llm:
            sub = KVEventSubscriber(f"ipc://{d}/ev")
            assert llm.publisher.wait_for_subscriber()  # type: ignore[attr-defined]
            expected = llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
            settle(llm, 5)
            files = sorted(tmp_path.rglob("*" + SUFFIX))
            assert len(files) == 5
            for f in files[:1]:
                raw = bytearray(f.read_bytes())
                raw[-10] ^= 0xFF
                f.write_bytes(bytes(raw))
            llm.reset_prefix_cache()
            out = llm.generate([PROMPT], GREEDY)[0]
            # The bad chunk leaves the tier (BlockRemoved) and, recomputed, is stored again.
            settle(llm, 7)
            assert out.outputs[0].token_ids == expected
            assert llm.scheduler.stats.num_recomputed_blocks > 0
            stats = llm.scheduler.connector_stats
            assert stats is not None and stats.data.get("num_disk_errors") == 1
            disk = [
                type(e).__name__
                for item in read_through(sub, llm.publisher)
                for e in item.batch.events
                if isinstance(e, BlockStored | BlockRemoved)
                and (e.medium, e.locality) == ("STORAGE", "LOCAL")
            ]
            sub.close()
            assert disk == ["BlockStored"] * 5 + ["BlockRemoved", "BlockStored"]
            assert_no_leaks(llm)


def test_a_disk_budget_too_small_for_a_chunk_is_counted_not_fatal(tmp_path: Path) -> None:
    cfg = offload({"kind": "disk", "path": str(tmp_path), "max_bytes": 1000})
    with LLM("tiny", kv_transfer_config=cfg) as llm:
        a = llm.generate([PROMPT], GREEDY)[0]

        def num_disk_errors() -> int:
            stats = llm.scheduler.connector_stats
            return 0 if stats is None else int(stats.data.get("num_disk_errors", 0))

        step_until(llm, lambda: num_disk_errors() >= 4)  # every chunk's store was refused
        llm.reset_prefix_cache()
        b = llm.generate([PROMPT], GREEDY)[0]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and b.num_external_tokens == 0
        stats = llm.scheduler.connector_stats
        assert stats is not None and stats.data["num_disk_errors"] >= 4
        assert_no_leaks(llm)


def test_in_a_multiconnector_both_childrens_events_are_published(tmp_path: Path) -> None:
    with tempfile.TemporaryDirectory() as d:
        events = {"enable_kv_cache_events": True, "endpoint": f"ipc://{d}/ev"}
        cfg = {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "connectors": [
                    offload({"kind": "cpu", "max_bytes": 1 << 26}),
                    {
                        "kv_connector": "WorkerEventsConnector",
                        "kv_connector_module_path": MODULE,
                        "kv_connector_extra_config": {"medium": "TEST"},
                    },
                ]
            },
        }
        with LLM(
            "tiny",
            tensor_parallel_size=2,
            kv_transfer_config=json.dumps(cfg),
            kv_events_config=events,
        ) as llm:
            sub = KVEventSubscriber(f"ipc://{d}/ev")
            assert llm.publisher.wait_for_subscriber()  # type: ignore[attr-defined]
            llm.generate([PROMPT], GREEDY)
            multi = llm.connector
            assert isinstance(multi, MultiConnector)
            offloader, _ = multi.connectors
            assert isinstance(offloader, OffloadConnector) and offloader.scheduler is not None
            quorum = offloader.scheduler.quorum
            step_until(llm, lambda: quorum.num_released >= 4)  # the CPU tier's 4 chunks
            media = [
                e.medium
                for item in read_through(sub, llm.publisher)
                for e in item.batch.events
                if isinstance(e, BlockStored)
            ]
            sub.close()
            assert_no_leaks(llm)
    assert sorted(media) == ["CPU"] * 4 + ["GPU", "TEST"]  # each once at TP=2
