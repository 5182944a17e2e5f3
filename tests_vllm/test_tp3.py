"""kvconnect's OffloadConnector inside `vllm serve` at tensor parallel 3 (SmolLM2-135M has 9
heads and 3 KV heads: one KV head per rank), a cpu tier, block size 64, chunk 256.

A prompt's KV, loaded back from the tier after vLLM's own cache was emptied, gives the greedy
answer the TP=1 server gives; each chunk's BlockStored comes once in vLLM's stream although
three ranks stored it (the connector's worker metadata, folded by vLLM across the ranks,
released by quorum in the scheduler).

Kept lean (three worker processes on two cores are slow): one server, two short prompts, vLLM's
cache emptied through its dev endpoint rather than by pushing other prompts through it.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests_vllm.conftest import VllmServer
from tests_vllm.test_offload import (
    BLOCK,
    CHUNK,
    Events,
    chunk_hashes,
    complete,
    external_hits,
    offload,
    prompt,
)
from tests_vllm.test_serve import wait_until

TP = 3
CHUNK_BYTES_PER_RANK = 30 * 2 * CHUNK * (3 // TP) * 64 * 4


@pytest.fixture(scope="module")
def tp3(model_dir: Path) -> Iterator[VllmServer]:
    config = offload([{"kind": "cpu", "max_bytes": 32 * CHUNK_BYTES_PER_RANK}])
    config["kv_load_failure_policy"] = "recompute"
    server = VllmServer(
        model_dir,
        BLOCK,
        cpu=0,
        extra_args=["--tensor-parallel-size", str(TP), "--kv-transfer-config", json.dumps(config)],
        # One core per rank (two are shared); the dev endpoint that empties vLLM's cache.
        extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0|1|0", "VLLM_SERVER_DEV_MODE": "1"},
    )
    try:
        server.start()
        server.wait()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tp3_events(tp3: VllmServer) -> Iterator[Events]:
    events = Events(tp3)
    yield events
    events.close()


@pytest.fixture(scope="module")
def tp1(vllm_servers: list[VllmServer]) -> VllmServer:
    (server,) = [s for s in vllm_servers if s.block_size == BLOCK]
    return server


def reset_prefix_cache(server: VllmServer) -> None:
    """vLLM's own cache only (not the connector's tiers)."""
    req = urllib.request.Request(server.url + "/reset_prefix_cache", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert json.load(resp)["success"] is True


def test_tp3_answers_from_the_cpu_tier_equal_tp1s_and_events_come_once(
    tp3: VllmServer, tp1: VllmServer, tp3_events: Events
) -> None:
    prompts = [prompt(seed, 2 * CHUNK + 40) for seed in (301, 302)]  # 2 chunks each
    expected = [complete(tp1, p)[0] for p in prompts]
    for p, want in zip(prompts, expected, strict=True):
        assert complete(tp3, p) == (want, 0)
    wait_until(lambda: len(tp3_events.stored("CPU")) >= 4, "the 4 chunks reach the cpu tier")
    reset_prefix_cache(tp3)
    for p, want in zip(prompts, expected, strict=True):
        before = external_hits(tp3)
        assert complete(tp3, p) == (want, 2 * CHUNK)
        assert external_hits(tp3) - before == 2 * CHUNK  # loaded by all three ranks
    hashes = chunk_hashes(tp3_events.stored("CPU"))
    assert len(hashes) == len(set(hashes)) == 4  # once each, not once per rank
