"""kvconnect's OffloadConnector inside real `vllm serve` processes (the vLLM plugin,
`kv_connector_module_path: "kvconnect.vllm"`), SmolLM2-135M on CPU, block size 64.

    a   OffloadConnector: cpu (24 chunks) -> disk, and a shared redis
    b   vLLM's MultiConnector: [OffloadConnector cpu, OffloadConnector redis]

vLLM's own cache holds 72 blocks (4,608 tokens), so a few other prompts push a prompt out of
it. A prompt pushed out comes back from a's cpu tier, from its disk after a restart, and from
redis in b; every answer is the one the plain vLLM server (no connector, same block size)
gives; the tiers' events arrive in vLLM's own stream once each; kvconnect router sends the
prompt where the tiers hold it; with redis killed every request still completes with the
same answer.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import random
import re
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvconnect.commands.redis_server import LocalRedis
from kvconnect.connector.offload.common import OffloadMetadata, OffloadWorkerMetadata
from kvconnect.events import MEDIUMS, BlockRemoved, BlockStored, KVCacheEvent, tier_of
from kvconnect.stream.subscriber import KVEventSubscriber, ReceivedBatch
from tests_vllm.conftest import VllmServer, post_json, start_router
from tests_vllm.test_serve import wait_until

BLOCK, CHUNK = 64, 256
GPU_BLOCKS = 72  # vLLM's own KV cache on the offload servers: 4,608 tokens
CHUNK_BYTES = 30 * 2 * CHUNK * 3 * 64 * 4  # layers x (K, V) x tokens x KV heads x dim x fp32


def offload(tiers: list[dict[str, Any]], by_name: bool = False) -> dict[str, Any]:
    """The connector's config: by module path, or by the name kvconnect's vLLM plugin
    registers (kvconnect is installed in vLLM's environment)."""
    config: dict[str, Any] = {
        "kv_connector": "OffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"chunk_size": CHUNK, "tiers": tiers},
    }
    if not by_name:
        config["kv_connector_module_path"] = "kvconnect.vllm"
    return config


def in_tier(e: BlockStored | BlockRemoved, tier: str) -> bool:
    """`e` speaks of `tier` (a label of `events.tier_of`) with a medium of vLLM 0.33 (the
    older DISK and EXTERNAL, which readers still take, never match)."""
    return e.medium in MEDIUMS and tier_of(e.medium, e.locality) == tier


class Events:
    """Every event of a server's stream, collected on a thread."""

    def __init__(self, server: VllmServer) -> None:
        self.items: list[KVCacheEvent] = []
        self.lock = threading.Lock()
        self.sub = KVEventSubscriber(server.events, server.replay, start_seq=0)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for item in self.sub:
            if isinstance(item, ReceivedBatch):
                with self.lock:
                    self.items.extend(item.batch.events)

    def stored(self, tier: str) -> list[BlockStored]:
        """BlockStored events of `tier` ("CPU", "STORAGE/REMOTE"), in vLLM 0.33's words."""
        with self.lock:
            return [e for e in self.items if isinstance(e, BlockStored) and in_tier(e, tier)]

    def removed(self, tier: str) -> list[BlockRemoved]:
        with self.lock:
            return [e for e in self.items if isinstance(e, BlockRemoved) and in_tier(e, tier)]

    def close(self) -> None:
        self.sub.close()


@pytest.fixture(scope="module")
def redis() -> Iterator[LocalRedis]:
    server = LocalRedis()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def servers(
    model_dir: Path, redis: LocalRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[VllmServer, VllmServer]]:
    disk = tmp_path_factory.mktemp("disk")
    shared = {"kind": "redis", "url": redis.url}
    a_config = offload(
        [
            {"kind": "cpu", "max_bytes": 24 * CHUNK_BYTES + CHUNK_BYTES // 2},
            {"kind": "disk", "path": str(disk), "max_bytes": 64 * CHUNK_BYTES},
            shared,
        ]
    )
    b_config = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "connectors": [
                offload([{"kind": "cpu", "max_bytes": 16 * CHUNK_BYTES}], by_name=True),
                offload([shared], by_name=True),
            ]
        },
    }
    made = []
    for cfg, cpu in ((a_config, 0), (b_config, 1)):
        cfg["kv_load_failure_policy"] = "recompute"
        made.append(
            VllmServer(
                model_dir,
                BLOCK,
                cpu=cpu,
                extra_args=[
                    "--kv-transfer-config",
                    json.dumps(cfg),
                    "--num-gpu-blocks-override",
                    str(GPU_BLOCKS),
                ],
            )
        )
    try:
        for s in made:
            s.start()
        for s in made:
            s.wait()
        yield made[0], made[1]
    finally:
        for s in made:
            s.stop()


@pytest.fixture(scope="module")
def a_events(servers: tuple[VllmServer, VllmServer]) -> Iterator[Events]:
    events = Events(servers[0])
    yield events
    events.close()


@pytest.fixture(scope="module")
def b_events(servers: tuple[VllmServer, VllmServer]) -> Iterator[Events]:
    events = Events(servers[1])
    yield events
    events.close()


def prompt(seed: int, num_tokens: int = 1030) -> list[int]:
    """Random token ids: 4 whole chunks (the last prompt token is always computed). With a
    12-token answer, 1,041 tokens are computed: no block past the chunks, so a finished
    request saves nothing more (test_peer_pull.py has the returning turn's tail)."""
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(num_tokens)]


def complete(server: VllmServer, tokens: list[int], **extra: Any) -> tuple[list[int], int]:
    """Greedy answer token ids and the prompt tokens vLLM did not compute; `extra` fields go
    into the request."""
    body = {
        "model": "smollm2",
        "prompt": tokens,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    answer, _ = post_json(server.url + "/v1/completions", body)
    details = answer["usage"].get("prompt_tokens_details") or {}
    return list(answer["choices"][0]["token_ids"]), int(details.get("cached_tokens") or 0)


def push_out(server: VllmServer, first_seed: int) -> None:
    """Enough other prompts through `server` that vLLM's own cache holds none of the earlier
    ones (its least recently used blocks are reused first)."""
    for seed in range(first_seed, first_seed + 5):  # 5 x 18 blocks > 72
        complete(server, prompt(seed))


def metric(server: VllmServer, name: str) -> float:
    """A counter of vLLM's /metrics, summed over its labels."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    return sum(float(v) for v in found)


def external_hits(server: VllmServer) -> float:
    """Prompt tokens vLLM says its KV connector supplied, so far."""
    return metric(server, "vllm:external_prefix_cache_hits_total")


def chunk_hashes(events: list[BlockStored]) -> list[tuple[int | bytes, ...]]:
    return [tuple(e.block_hashes) for e in events]


@pytest.fixture(scope="module")
def plain(vllm_servers: list[VllmServer]) -> VllmServer:
    """The plain vLLM server at the same block size: the answers to match."""
    (server,) = [s for s in vllm_servers if s.block_size == BLOCK]
    return server


def test_a_prompt_pushed_out_of_vllm_comes_back_from_the_cpu_tier(
    servers: tuple[VllmServer, VllmServer], plain: VllmServer, a_events: Events
) -> None:
    a, _ = servers
    p = prompt(1)
    expected, _ = complete(plain, p)
    first, cached = complete(a, p)
    assert first == expected and cached == 0
    push_out(a, 100)
    before = external_hits(a)
    again, cached = complete(a, p)
    assert again == expected
    assert cached == 4 * CHUNK
    assert external_hits(a) - before == cached  # all of it loaded by the connector
    # The connector's own counters, in vLLM's /metrics (through get_kv_connector_stats).
    wait_until(lambda: metric(a, "kvconnect:offload_cpu_hits_total") >= 4, "cpu hits counted")
    assert metric(a, "kvconnect:offload_cpu_bytes_loaded_total") >= 4 * CHUNK_BYTES
    wait_until(
        lambda: metric(a, "kvconnect:offload_cpu_bytes_stored_total") >= 24 * CHUNK_BYTES,
        "24 chunks' bytes counted as stored",
    )


def test_tier_events_come_in_vllms_stream_once_each_with_vllms_hashes(a_events: Events) -> None:
    wait_until(lambda: len(a_events.stored("STORAGE/REMOTE")) >= 24, "a's 24 chunks reach redis")
    cpu = a_events.stored("CPU")
    hashes = chunk_hashes(cpu)
    assert len(hashes) == len(set(hashes)) == 24  # the reload stored nothing twice
    gpu = {h for e in a_events.stored("GPU") for h in e.block_hashes}
    for i, e in enumerate(cpu[:4]):  # the first prompt's chunks
        assert e.block_size == BLOCK and len(e.token_ids) == CHUNK
        assert len(e.block_hashes) == CHUNK // BLOCK
        assert set(e.block_hashes) <= gpu  # the very hashes vLLM published for its blocks
        assert e.parent_block_hash == (cpu[i - 1].block_hashes[-1] if i else None)
    external = chunk_hashes(a_events.stored("STORAGE/REMOTE"))
    assert sorted(external, key=repr) == sorted(hashes, key=repr)  # written through, once each


def test_evicted_chunks_are_announced_and_demoted_to_disk(
    servers: tuple[VllmServer, VllmServer], plain: VllmServer, a_events: Events
) -> None:
    a, _ = servers
    for seed in (2, 3):  # 8 more chunks into a full cpu tier of 24
        assert complete(a, prompt(seed))[0] == complete(plain, prompt(seed))[0]
    wait_until(lambda: len(a_events.removed("CPU")) >= 8, "8 chunks leave the cpu tier")
    removed = [tuple(e.block_hashes) for e in a_events.removed("CPU")]
    on_disk = chunk_hashes(a_events.stored("STORAGE/LOCAL"))
    assert len(removed) == len(set(removed)) == 8
    assert removed == on_disk  # each evicted chunk went down to disk, in order
    # Least recently used first: the first prompt was read back since, so the first two
    # prompts that pushed it out of vLLM's cache go.
    assert removed == chunk_hashes(a_events.stored("CPU"))[4:12]


def test_the_disk_tier_serves_after_a_restart(
    servers: tuple[VllmServer, VllmServer], plain: VllmServer, a_events: Events
) -> None:
    a, _ = servers
    a.restart()
    p = prompt(100)  # demoted to disk by the previous test; vLLM's own cache starts empty
    before = external_hits(a)
    answer, cached = complete(a, p)
    assert answer == complete(plain, p)[0]
    assert cached == 4 * CHUNK and external_hits(a) - before == cached


def test_a_second_server_loads_from_the_shared_redis_inside_a_multiconnector(
    servers: tuple[VllmServer, VllmServer],
    plain: VllmServer,
    a_events: Events,
    b_events: Events,
) -> None:
    a, b = servers
    p = prompt(2)  # stored (and written to redis) by a only, before a's restart
    written = set(chunk_hashes(a_events.stored("STORAGE/REMOTE")))
    a_cpu = chunk_hashes(a_events.stored("CPU"))
    assert set(a_cpu[24:28]) <= written, f"a announced prompt 2's chunks in redis: {a.warnings()}"
    answer, cached = complete(b, p)
    assert answer == complete(plain, p)[0]
    assert cached == 4 * CHUNK, f"b loaded {cached} tokens from redis: {b.warnings()}"
    # Both children's events arrive in b's stream: the cpu child stored what was loaded,
    # the redis child wrote it through again.
    wait_until(lambda: len(b_events.stored("CPU")) >= 4, "b's cpu child announces 4 chunks")
    wait_until(lambda: len(b_events.stored("STORAGE/REMOTE")) >= 4, "b's redis child announces 4")


def test_the_router_sends_a_prompt_to_the_server_whose_tiers_hold_it(
    servers: tuple[VllmServer, VllmServer], plain: VllmServer, a_events: Events
) -> None:
    a, b = servers
    p = prompt(4)
    complete(a, p)
    push_out(a, 200)
    with start_router([a, b]) as router:
        wait_until(lambda: held_by(router.url, a, p) >= 4 * CHUNK, "the router sees a's tiers")
        body = {"model": "smollm2", "prompt": p, "max_tokens": 4, "temperature": 0}
        answer, headers = post_json(router.url + "/v1/completions", body)
        assert headers["x-kvconnect-instance"] == a.url
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * CHUNK


def held_by(router: str, server: VllmServer, tokens: list[int]) -> int:
    answer, _ = post_json(router + "/kv/score", {"prompt": tokens})
    score = answer["instances"][server.url]
    return int(score["cached_tokens"])


def test_with_redis_killed_every_request_completes_with_the_same_answer(
    servers: tuple[VllmServer, VllmServer], plain: VllmServer, redis: LocalRedis
) -> None:
    a, b = servers
    redis.stop()
    for server in (b, a):
        for seed in (4, 5):  # 4: in redis, never seen by b; 5: new
            assert complete(server, prompt(seed))[0] == complete(plain, prompt(seed))[0]


def test_the_plugins_metadata_types_are_vllms_and_carry_every_field_of_kvconnects() -> None:
    """The halves build these (their `metadata_class`): vLLM sees its own types, the workers
    every field the scheduler half set (tests/test_vllm_boundary.py drives the halves)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )

    from kvconnect.vllm.adapter import OffloadMetadataForVllm, OffloadWorkerMetadataForVllm

    meta = OffloadMetadataForVllm(reset=True, shared_gone=[b"gone"])
    assert isinstance(meta, KVConnectorMetadata) and isinstance(meta, OffloadMetadata)
    assert [f.name for f in dataclasses.fields(meta)] == [
        f.name for f in dataclasses.fields(OffloadMetadata)
    ]
    assert pickle.loads(pickle.dumps(meta)) == meta  # as vLLM sends it to its workers
    worker = OffloadWorkerMetadataForVllm({0: []}, {0: 1})
    assert isinstance(worker, KVConnectorWorkerMetadata)
    assert isinstance(worker, OffloadWorkerMetadata)
    folded = worker.aggregate(OffloadWorkerMetadataForVllm({1: []}, {1: 0}))
    assert type(folded) is OffloadWorkerMetadataForVllm and folded.pending_io == {0: 1, 1: 0}
