"""Peer pulls inside real `vllm serve` processes (kvconnect's plugin on both, SmolLM2-135M on
CPU, block size 64, chunks of 256): a request to b whose `kv_transfer_params` (vLLM's own
request field) names a's peer port pulls the 4 chunks a holds into b's blocks, and b answers as
a does; a host not in b's peer sources is never asked, and b computes the same answer.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests_vllm.conftest import VllmServer, free_port, post_json
from tests_vllm.test_offload import Events, external_hits
from tests_vllm.test_serve import wait_until

BLOCK, CHUNK = 64, 256
CHUNK_BYTES = 30 * 2 * CHUNK * 3 * 64 * 4


def config(peer_port: int) -> dict[str, Any]:
    return {
        "kv_connector": "OffloadConnector",
        "kv_connector_module_path": "kvconnect.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "chunk_size": CHUNK,
            "tiers": [{"kind": "cpu", "max_bytes": 16 * CHUNK_BYTES}],
            "peer": {"port": peer_port},
        },
    }


@pytest.fixture(scope="module")
def pair(model_dir: Path) -> Iterator[tuple[VllmServer, VllmServer, int]]:
    a_port = free_port()
    made = [
        VllmServer(
            model_dir, BLOCK, cpu=cpu, extra_args=["--kv-transfer-config", json.dumps(config(p))]
        )
        for cpu, p in ((0, a_port), (1, free_port()))
    ]
    try:
        for s in made:
            s.start()
        for s in made:
            s.wait()
        yield made[0], made[1], a_port
    finally:
        for s in made:
            s.stop()


def complete(server: VllmServer, tokens: list[int], **extra: Any) -> tuple[list[int], int]:
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


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(1100)]  # 4 whole chunks


def source(port: int, host: str = "127.0.0.1") -> dict[str, Any]:
    return {"kv_transfer_params": {"remote_kv_source": {"host": host, "port": port}}}


def test_a_request_naming_a_peer_pulls_its_chunks_into_vllm(
    pair: tuple[VllmServer, VllmServer, int],
) -> None:
    """b then holds the chunks in its own cpu tier and announces them in vLLM's stream: the
    same chunks (block hashes) a announced."""
    a, b, a_port = pair
    a_events, b_events = Events(a), Events(b)
    try:
        tokens = prompt(1)
        answer, _ = complete(a, tokens)
        wait_until(lambda: len(a_events.stored("CPU")) >= 4, "a's 4 chunks in its cpu tier")
        before = external_hits(b)
        pulled, cached = complete(b, tokens, **source(a_port))
        assert pulled == answer
        assert cached == external_hits(b) - before == 4 * CHUNK, b.log.read_text()[-3000:]
        wait_until(lambda: len(b_events.stored("CPU")) >= 4, "b's 4 pulled chunks announced")
        hashes = [e.block_hashes for e in a_events.stored("CPU")]
        assert [e.block_hashes for e in b_events.stored("CPU")] == hashes
    finally:
        a_events.close()
        b_events.close()


def test_a_host_not_in_the_sources_is_never_asked(
    pair: tuple[VllmServer, VllmServer, int],
) -> None:
    a, b, a_port = pair
    tokens = prompt(2)
    answer, _ = complete(a, tokens)
    before = external_hits(b)
    assert complete(b, tokens, **source(a_port, host="localhost")) == (answer, 0)
    assert external_hits(b) == before
    assert "not in the peer config's sources" in b.log.read_text()
