"""What Redis drops on its own reaches the event stream: evictions (a small maxmemory with
allkeys-lru), expiries (ttl_s), a restarted server (resync); and a connector reset announces
exactly what its tiers dropped. Real engine, real redis-server, real subscriber and index."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from kvconnect import LLM, SamplingParams
from kvconnect.commands.redis_server import LocalRedis
from kvconnect.connector.offload.common import chunk_key
from kvconnect.connector.offload.connector import OffloadConnector
from kvconnect.connector.offload.tiers.base import unpack
from kvconnect.connector.offload.tiers.redis_client import KEY_PREFIX
from kvconnect.connector.offload.tiers.redis_watch import RedisWatcher, last_hash_of
from kvconnect.events import (
    LOCALITY_REMOTE,
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    MEDIUMS,
    TIER_CPU,
    TIER_STORAGE_REMOTE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    tier_of,
)
from kvconnect.router.index import BlockIndex
from kvconnect.stream.subscriber import KVEventSubscriber, ReceivedBatch
from tests.conftest import start_redis
from tests.connector.offload.test_offload_engine import CHUNK, offload, step_until

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=2, ignore_eos=True)


CHUNKS, ENTRIES = 4, 5
"""What one prompt below stores: its 4 whole chunks, and in a local tier, once the request
ends (151 tokens computed), a tail of one block (tokens 128-143) too."""


def prompt(i: int) -> list[int]:
    """150 tokens: 4 whole chunks of 32."""
    return [random.Random(i).randrange(256) for _ in range(150)]


class Instance:
    """An engine with a connector, its event stream followed into a router's index."""

    def __init__(self, tmp: Path, *tiers: dict[str, Any]) -> None:
        events = {
            "enable_kv_cache_events": True,
            "endpoint": f"ipc://{tmp}/ev",
            "replay_endpoint": f"ipc://{tmp}/replay",
            "bind": True,
        }
        self.llm = LLM("tiny", kv_transfer_config=offload(*tiers), kv_events_config=events)
        # The replay endpoint repairs what a SUB that joins late misses (ZMQ's slow joiner):
        # the tests compare every event ever published with what the tiers hold.
        self.sub = KVEventSubscriber(f"ipc://{tmp}/ev", f"ipc://{tmp}/replay", start_seq=0)
        self.index = BlockIndex()
        self.events: list[KVCacheEvent] = []

    def drain(self) -> None:
        while (item := self.sub.recv(timeout=0.05)) is not None:
            self.index.apply_item("i", item)
            if isinstance(item, ReceivedBatch):
                self.events += item.batch.events

    def until(self, condition: Any, what: str = "") -> None:
        """Step the engine and read the stream until `condition()` holds."""

        def done() -> bool:
            self.drain()
            return bool(condition())

        step_until(self.llm, done)

    def count(self, kind: type, tier: str) -> int:
        return sum(isinstance(e, kind) and in_tier(e, tier) for e in self.events)

    def removed_chunks(self, tier: str) -> list[tuple[Any, ...]]:
        return [
            tuple(e.block_hashes)
            for e in self.events
            if isinstance(e, BlockRemoved) and in_tier(e, tier)
        ]

    @property
    def watcher(self) -> RedisWatcher:
        connector = self.llm.connector
        assert isinstance(connector, OffloadConnector) and connector.scheduler is not None
        watcher = connector.scheduler.watcher
        assert isinstance(watcher, RedisWatcher)
        return watcher

    def close(self) -> None:
        self.sub.close()
        self.llm.shutdown()


def in_tier(e: Any, tier: str) -> bool:
    """`e` speaks of `tier` (a label of `events.tier_of`: "STORAGE/REMOTE") in vLLM 0.33's
    words: the older mediums (DISK, EXTERNAL), which readers still take, never match."""
    return e.medium in MEDIUMS and tier_of(e.medium, e.locality) == tier


def redis_blocks(client: redis.Redis) -> set[Any]:
    """Every block hash the chunks Redis still holds describe (from their own headers)."""
    blocks: set[Any] = set()
    for key in client.scan_iter(match=KEY_PREFIX + "*"):
        value = client.get(key)
        if value is not None:
            info, _ = unpack(value, key.decode().removeprefix(KEY_PREFIX))
            blocks.update(info.block_hashes)
    return blocks


@pytest.fixture
def server() -> Iterator[LocalRedis]:
    s = start_redis()
    yield s
    s.stop()


def test_every_eviction_is_announced_once_and_the_index_matches_redis(
    tmp_path: Path, server: LocalRedis
) -> None:
    client = redis.Redis(port=server.port)
    inst = Instance(tmp_path, {"kind": "redis", "url": server.url})
    try:
        inst.llm.generate([prompt(0)], GREEDY)
        inst.until(lambda: inst.count(BlockStored, TIER_STORAGE_REMOTE) == CHUNKS)
        chunk_bytes = max(len(client.get(k) or b"") for k in client.scan_iter(KEY_PREFIX + "*"))
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", used + 6 * chunk_bytes)  # room for ~10 chunks
        client.config_set("maxmemory-policy", "allkeys-lru")
        for i in range(1, 8):
            inst.llm.generate([prompt(i)], GREEDY)
        inst.until(lambda: inst.count(BlockStored, TIER_STORAGE_REMOTE) == 8 * CHUNKS)
        evicted = int(client.info("stats")["evicted_keys"])
        assert evicted >= 10
        inst.until(lambda: len(inst.removed_chunks(TIER_STORAGE_REMOTE)) == evicted)
        removed = inst.removed_chunks(TIER_STORAGE_REMOTE)
        assert len(set(removed)) == len(removed)  # each chunk exactly once
        assert inst.index.blocks_of("i", MEDIUM_STORAGE, LOCALITY_REMOTE) == redis_blocks(client)
        inst.index.check_integrity()
    finally:
        inst.close()


def test_expired_chunks_are_announced(tmp_path: Path, server: LocalRedis) -> None:
    client = redis.Redis(port=server.port)
    inst = Instance(tmp_path, {"kind": "redis", "url": server.url, "ttl_s": 0.5})
    try:
        inst.llm.generate([prompt(0), prompt(1)], GREEDY)
        inst.until(lambda: inst.count(BlockStored, TIER_STORAGE_REMOTE) == 2 * CHUNKS)
        inst.until(lambda: len(inst.removed_chunks(TIER_STORAGE_REMOTE)) == 2 * CHUNKS)
        assert (
            redis_blocks(client)
            == set()
            == inst.index.blocks_of("i", MEDIUM_STORAGE, LOCALITY_REMOTE)
        )
    finally:
        inst.close()


def test_a_restarted_redis_is_resynced_and_written_again(
    tmp_path: Path, server: LocalRedis
) -> None:
    inst = Instance(tmp_path, {"kind": "redis", "url": server.url})
    try:
        inst.llm.generate([prompt(0)], GREEDY)
        inst.until(lambda: inst.count(BlockStored, TIER_STORAGE_REMOTE) == CHUNKS)
        resyncs = inst.watcher.num_resyncs
        server.stop()  # every key is gone with it (no persistence)
        restarted = LocalRedis(port=server.port)
        try:
            inst.until(lambda: len(inst.removed_chunks(TIER_STORAGE_REMOTE)) == CHUNKS)
            assert inst.watcher.num_resyncs > resyncs
            assert inst.index.blocks_of("i", MEDIUM_STORAGE, LOCALITY_REMOTE) == set()
            # Notifications are on again on the new server, and the workers write again
            # what the scheduler told them is gone.
            client = redis.Redis(port=restarted.port)
            assert "e" in client.config_get("notify-keyspace-events")["notify-keyspace-events"]
            assert inst.llm.reset_prefix_cache()
            inst.llm.generate([prompt(0)], GREEDY)
            inst.until(lambda: inst.count(BlockStored, TIER_STORAGE_REMOTE) == 2 * CHUNKS)
            assert (
                inst.index.blocks_of("i", MEDIUM_STORAGE, LOCALITY_REMOTE)
                == redis_blocks(client)
                != set()
            )
        finally:
            restarted.stop()
    finally:
        inst.close()


def test_a_server_that_forbids_config_gets_a_clear_warning_and_preset_flags_work(
    tmp_path: Path, server: LocalRedis, caplog: pytest.LogCaptureFixture
) -> None:
    admin = redis.Redis(port=server.port)
    admin.acl_setuser(
        "app",
        enabled=True,
        passwords=["+pw"],
        commands=["+@all", "-config"],
        keys=["*"],
        channels=["*"],
    )
    url = f"redis://app:pw@127.0.0.1:{server.port}/0"
    with caplog.at_level(logging.WARNING):
        inst = Instance(tmp_path, {"kind": "redis", "url": url, "ttl_s": 0.3})
        try:
            assert inst.watcher.connected.wait(10)
        finally:
            inst.close()
    assert "set notify-keyspace-events to include 'Eex'" in caplog.text
    assert "pw" not in caplog.text  # the password never reaches a log line
    admin.config_set("notify-keyspace-events", "Eex")  # what the operator does
    inst = Instance(tmp_path, {"kind": "redis", "url": url, "ttl_s": 0.3})
    try:
        inst.llm.generate([prompt(0)], GREEDY)
        inst.until(lambda: len(inst.removed_chunks(TIER_STORAGE_REMOTE)) == CHUNKS)
    finally:
        inst.close()


def test_a_connector_reset_removes_its_tiers_entries_and_leaves_the_gpu_ones(
    tmp_path: Path,
) -> None:
    inst = Instance(tmp_path, {"kind": "cpu", "max_bytes": 1 << 24})
    try:
        inst.llm.generate([prompt(0)], GREEDY)
        inst.until(lambda: inst.count(BlockStored, TIER_CPU) == ENTRIES)
        gpu = inst.index.blocks_of("i", MEDIUM_GPU)
        assert gpu and len(inst.index.blocks_of("i", MEDIUM_CPU)) == (4 * CHUNK + 16) // 16
        assert inst.llm.reset_connector_cache()
        inst.until(lambda: inst.count(BlockRemoved, TIER_CPU) == ENTRIES)
        assert not any(isinstance(e, AllBlocksCleared) for e in inst.events)
        assert inst.index.blocks_of("i", MEDIUM_CPU) == set()
        assert inst.index.blocks_of("i", MEDIUM_GPU) == gpu
        inst.index.check_integrity()
    finally:
        inst.close()


def test_keys_of_another_model_or_world_size_are_not_this_instances_to_announce() -> None:
    prefix, digest = KEY_PREFIX + "m/1/", "ab" * 32
    key = KEY_PREFIX + chunk_key("m", 1, 0, bytes.fromhex(digest))
    assert key == f"{prefix}0/{{{digest}}}"  # the hash tag keeps a chunk's ranks in one slot
    assert last_hash_of(key.encode(), prefix) == bytes.fromhex(digest)
    for key in (
        f"{KEY_PREFIX}other/1/0/{{{digest}}}",
        f"{KEY_PREFIX}m/2/0/{{{digest}}}",
        "unrelated",
        f"{prefix}0/{{zz}}",
        f"{prefix}0/{digest}",
        f"{prefix}x/{{{digest}}}",
        f"{prefix}0/",
    ):
        assert last_hash_of(key, prefix) is None, key
    assert CHUNK == 32  # the chunk size the prompts above are cut by
