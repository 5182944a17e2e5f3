"""The offload connector inside the real engine: worker processes, real tiers, real redis."""

import json
import logging
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from kvconnect import LLM, SamplingParams
from kvconnect.connector.offload.tiers.disk import SUFFIX
from kvconnect.events import BlockRemoved, BlockStored
from kvconnect.redis_server import LocalRedis
from kvconnect.subscriber import KVEventSubscriber, ReceivedBatch
from tests.conftest import start_redis
from tests.connector.helpers import MODULE
from tests.helpers import SETTLE_S

pytestmark = pytest.mark.slow

CHUNK = 32
PROMPT = [random.Random(9).randrange(256) for _ in range(150)]  # 4 whole chunks + 22 tokens
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def offload(*tiers: dict[str, Any]) -> dict[str, Any]:
    return {
        "kv_connector": "OffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"chunk_size": CHUNK, "tiers": list(tiers)},
    }


def settle(llm: LLM, steps: int = 20) -> None:
    """Let the workers' I/O threads finish and their events reach the scheduler."""
    for _ in range(steps):
        llm.step()
        time.sleep(0.01)


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
        settle(llm)
        assert llm.reset_prefix_cache() is True  # the engine's own cache only
        again = llm.generate([PROMPT], GREEDY)[0]
        assert again.num_external_tokens == 4 * CHUNK and again.num_cached_tokens == 0
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        stats = llm.scheduler.connector_stats
        assert stats is not None and stats.data["num_chunks_loaded"] == 4 * tp
        llm.scheduler.check_integrity()


def test_a_second_instance_reuses_the_first_ones_kv_through_redis(
    fresh_redis: LocalRedis,
) -> None:
    cfg = offload({"kind": "redis", "url": fresh_redis.url})
    with LLM("tiny", tensor_parallel_size=2, kv_transfer_config=cfg) as first:
        expected = first.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
        settle(first)
    with LLM("tiny", tensor_parallel_size=2, kv_transfer_config=cfg) as second:
        out = second.generate([PROMPT], GREEDY)[0]
    assert out.num_external_tokens == 4 * CHUNK and out.outputs[0].token_ids == expected


def test_redis_stopped_mid_run_still_gives_correct_output(caplog: pytest.LogCaptureFixture) -> None:
    server = start_redis()
    try:
        with LLM("tiny", kv_transfer_config=offload({"kind": "redis", "url": server.url})) as llm:
            expected = llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
            settle(llm)
            server.stop()
            llm.reset_prefix_cache()
            with caplog.at_level(logging.WARNING):
                out = llm.generate([PROMPT], GREEDY)[0]
            assert out.outputs[0].token_ids == expected and out.num_external_tokens == 0
            assert llm.connector is not None and llm.connector.scheduler is not None
            lookup = llm.connector.scheduler.lookup
            assert lookup is not None and lookup.num_errors >= 1
            assert "shared tier lookup failed" in caplog.text
    finally:
        server.stop()


def test_a_corrupted_disk_chunk_is_recomputed_and_reported(tmp_path: Path) -> None:
    with tempfile.TemporaryDirectory() as d:
        events = {"enable_kv_cache_events": True, "endpoint": f"ipc://{d}/ev"}
        cfg = offload({"kind": "disk", "path": str(tmp_path), "max_bytes": 1 << 28})
        with LLM("tiny", kv_transfer_config=cfg, kv_events_config=events) as llm:
            sub = KVEventSubscriber(f"ipc://{d}/ev")
            time.sleep(SETTLE_S)
            expected = llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
            settle(llm)
            files = sorted(tmp_path.rglob("*" + SUFFIX))
            assert len(files) == 4
            for f in files[:1]:
                raw = bytearray(f.read_bytes())
                raw[-10] ^= 0xFF
                f.write_bytes(bytes(raw))
            llm.reset_prefix_cache()
            out = llm.generate([PROMPT], GREEDY)[0]
            settle(llm)
            assert out.outputs[0].token_ids == expected
            assert llm.scheduler.stats.num_recomputed_blocks > 0
            stats = llm.scheduler.connector_stats
            assert stats is not None and stats.data.get("num_disk_errors") == 1
            removed = []
            while (item := sub.recv(timeout=0.5)) is not None:
                assert isinstance(item, ReceivedBatch)
                removed += [
                    e
                    for e in item.batch.events
                    if isinstance(e, BlockRemoved) and e.medium == "DISK"
                ]
            sub.close()
            assert len(removed) == 1  # the bad chunk left the tier, and the stream says so


def test_a_disk_budget_too_small_for_a_chunk_is_counted_not_fatal(tmp_path: Path) -> None:
    cfg = offload({"kind": "disk", "path": str(tmp_path), "max_bytes": 1000})
    with LLM("tiny", kv_transfer_config=cfg) as llm:
        a = llm.generate([PROMPT], GREEDY)[0]
        settle(llm)
        llm.reset_prefix_cache()
        b = llm.generate([PROMPT], GREEDY)[0]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and b.num_external_tokens == 0
        stats = llm.scheduler.connector_stats
        assert stats is not None and stats.data["num_disk_errors"] >= 4


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
            time.sleep(SETTLE_S)
            llm.generate([PROMPT], GREEDY)
            settle(llm)
            media: list[str | None] = []
            while (item := sub.recv(timeout=0.5)) is not None:
                assert isinstance(item, ReceivedBatch)
                media += [e.medium for e in item.batch.events if isinstance(e, BlockStored)]
            sub.close()
    assert sorted(media) == ["CPU"] * 4 + ["GPU", "TEST"]  # each once at TP=2
