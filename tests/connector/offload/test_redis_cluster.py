"""The redis tier against a real Redis Cluster (three masters with a replica each, started
here): round trips across slots, one EXISTS per chunk whatever its ranks, an engine reusing its
KV through the cluster, and a master failing over mid-run without a wrong or failed request."""

from __future__ import annotations

import os
import random
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from redis.cluster import RedisCluster

from kvconnect import LLM, SamplingParams
from kvconnect.commands.redis_server import LocalRedisCluster
from kvconnect.connector.offload.common import ChunkInfo, OffloadConfig, chunk_key
from kvconnect.connector.offload.tiers.base import TierError
from kvconnect.connector.offload.tiers.redis import RedisTier
from kvconnect.connector.offload.tiers.redis_client import KEY_PREFIX
from tests.connector.offload.test_offload_engine import CHUNK, offload, settle
from tests.helpers import RedisMonitor

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
SHAPE = (2, 2, 8, 2, 4)


@pytest.fixture
def cluster() -> Iterator[LocalRedisCluster]:
    c = LocalRedisCluster()
    yield c
    c.stop()


def chunk(i: int) -> tuple[bytes, ChunkInfo, torch.Tensor]:
    last = i.to_bytes(32, "big")
    info = ChunkInfo(last, (i * 10, i * 10 + 1), None, (i,) * 8, 4)
    return last, info, torch.full(SHAPE, float(i))


def test_round_trips_across_slots_and_one_exists_per_chunk(cluster: LocalRedisCluster) -> None:
    tiers = [RedisTier(cluster.url, cluster=True) for _ in range(2)]  # two ranks
    tiers[0].check_reachable()
    chunks = [chunk(i) for i in range(40)]
    for last, info, data in chunks:
        for rank, tier in enumerate(tiers):
            tier.put(chunk_key("m", 2, rank, last), info, data + rank)
    client = RedisCluster.from_url(cluster.url)
    slots = {client.keyslot(KEY_PREFIX + chunk_key("m", 2, 0, last)) for last, _, _ in chunks}
    assert len(slots) > 10  # the chunks are spread over the cluster
    for last, _, data in chunks:
        k0, k1 = (KEY_PREFIX + chunk_key("m", 2, r, last) for r in range(2))
        assert client.keyslot(k0) == client.keyslot(k1)  # a chunk's ranks share a slot
        got = tiers[1].get(chunk_key("m", 2, 1, last))
        assert got is not None and torch.equal(got, data + 1)
    keys = [[chunk_key("m", 2, r, last) for r in range(2)] for last, _, _ in chunks]
    assert tiers[0].num_held_prefix(keys) == 40
    client.delete(KEY_PREFIX + keys[25][1])  # one rank's key of chunk 25 gone
    assert tiers[0].num_held_prefix(keys) == 25
    for t in tiers:
        t.close()


def test_config_takes_cluster_for_redis_only() -> None:
    base = {"chunk_size": 32}
    cfg = OffloadConfig.from_extra_config(
        {**base, "tiers": [{"kind": "redis", "url": "redis://127.0.0.1:1", "cluster": True}]}, 16
    )
    assert cfg.tiers[0].cluster is True
    with pytest.raises(ValueError, match=r"Expected `bool`, got `str` - at `tiers\[0\]\.cluster`"):
        OffloadConfig.from_extra_config(
            {**base, "tiers": [{"kind": "redis", "url": "redis://h:1", "cluster": "yes"}]}, 16
        )
    with pytest.raises(ValueError, match="redis options"):
        OffloadConfig.from_extra_config({**base, "tiers": [{"kind": "cpu", "cluster": True}]}, 16)
    with pytest.raises(ValueError, match="unreachable"):
        RedisTier("redis://127.0.0.1:1", cluster=True).check_reachable()


def prompts() -> list[list[int]]:
    r = random.Random(4)
    system = [r.randrange(256) for _ in range(2 * CHUNK)]
    return [system + [r.randrange(256) for _ in range(3 * CHUNK + i)] for i in range(4)]


def test_an_engine_reuses_kv_through_the_cluster_and_survives_a_failover(
    cluster: LocalRedisCluster, tmp_path: Path
) -> None:
    ps = prompts()
    with LLM("tiny") as ref:
        expected = [o.outputs[0].token_ids for o in ref.generate(ps, GREEDY)]
    cfg = offload({"kind": "redis", "url": cluster.url, "cluster": True})
    with LLM("tiny", tensor_parallel_size=2, kv_transfer_config=cfg) as llm:
        out = llm.generate(ps, GREEDY)
        assert [o.outputs[0].token_ids for o in out] == expected
        settle(llm, 2 + 4 * 3)  # every chunk stored (events released by both ranks)
        llm.reset_prefix_cache()
        out = llm.generate(ps, GREEDY)
        assert [o.outputs[0].token_ids for o in out] == expected
        assert sum(o.num_external_tokens for o in out) > 0  # loaded from the cluster
        # A master dies while the next round's loads read: its replica takes over.
        monitor = RedisMonitor([n.port for n in cluster.masters()])
        killed: list[int] = []

        def kill_on_third_get() -> None:
            try:
                monitor.wait("get", 3, timeout=30)  # on time or not: the round must not fail
            finally:
                monitor.close()
            victim = cluster.masters()[0]
            killed.append(victim.port)
            os.kill(victim.proc.pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_on_third_get, daemon=True)
        llm.reset_prefix_cache()
        killer.start()
        out = llm.generate(ps, GREEDY)
        killer.join(timeout=30)
        assert killed, "the master was never killed"
        assert [o.outputs[0].token_ids for o in out] == expected  # no request failed or drifted
        cluster.wait_ok()  # the replica is master now
        for _ in range(2):  # stores resume through the new master; loads follow
            llm.reset_prefix_cache()
            out = llm.generate(ps, GREEDY)
            assert [o.outputs[0].token_ids for o in out] == expected
        llm.scheduler.check_integrity()
        pool = llm.scheduler.pool
        assert pool.num_free_blocks == pool.num_blocks


def test_an_unreachable_cluster_is_an_error_not_a_hang() -> None:
    tier = RedisTier("redis://127.0.0.1:1", cluster=True)
    with pytest.raises(TierError):
        tier.get("m/1/0/{00}")
    assert tier.contains("m/1/0/{00}") is False
