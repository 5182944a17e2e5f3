"""Peer pulls inside real `vllm serve` processes (kvconnect's plugin on both, SmolLM2-135M on
CPU, block size 64, chunks of 256): a request to b whose `kv_transfer_params` (vLLM's own
request field) names a's peer port pulls the 4 chunks a holds into b's blocks, and b answers as
a does; a host not in b's peer sources is never asked, and b computes the same answer.
P/D between the two, driven as vLLM's toy proxy drives NixlConnector pairs, decodes the
monolithic answer; malformed params are a warning, and the engine serves on. A chat's
returning turn loads what its first turn computed, answer and tail included.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvconnect.router.pd import TO_PREFILL
from tests_vllm.conftest import VllmServer, free_port, kvconnect_plugin, post_json, running
from tests_vllm.test_offload import Events, complete, external_hits, prompt
from tests_vllm.test_serve import wait_until

BLOCK, CHUNK = 64, 256
CHUNK_BYTES = 30 * 2 * CHUNK * 3 * 64 * 4


def config(peer_port: int, sources: tuple[int, ...] = ()) -> dict[str, Any]:
    return kvconnect_plugin(
        {
            "chunk_size": CHUNK,
            "tiers": [{"kind": "cpu", "max_bytes": 16 * CHUNK_BYTES}],
            "peer": {"port": peer_port, "sources": [f"127.0.0.1:{p}" for p in sources]},
        }
    )


@pytest.fixture(scope="module")
def pair(model_dir: Path) -> Iterator[tuple[VllmServer, VllmServer, int]]:
    a_port = free_port()
    made = [
        VllmServer(
            model_dir,
            BLOCK,
            cpu=cpu,
            extra_args=["--kv-transfer-config", json.dumps(config(p, sources))],
            extra_env={"VLLM_SERVER_DEV_MODE": "1"},  # /reset_prefix_cache
        )
        for cpu, p, sources in ((0, a_port, ()), (1, free_port(), (a_port,)))
    ]
    with running(made):
        yield made[0], made[1], a_port


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


def test_a_peer_not_in_the_sources_is_never_asked(
    pair: tuple[VllmServer, VllmServer, int],
) -> None:
    """vLLM's server passes kv_transfer_params on unchecked: the plugin refuses a peer that is
    not configured (another host for a, b's own HTTP port), logs it and computes."""
    a, b, a_port = pair
    before = external_hits(b)
    own = int(b.url.rsplit(":", 1)[1])
    for seed, named in ((2, source(a_port, host="localhost")), (12, source(own))):
        tokens = prompt(seed)
        answer, _ = complete(a, tokens)
        assert complete(b, tokens, **named) == (answer, 0)
    assert external_hits(b) == before
    assert "is not one of this instance's peers" in b.log.read_text()


def test_pd_between_two_vllm_servers_in_nixl_connectors_handshake(
    pair: tuple[VllmServer, VllmServer, int],
) -> None:
    """Driven as vLLM's toy proxy drives NixlConnector pairs: P (a) runs the prompt with
    max_tokens 1 and answers, in vLLM's own `kv_transfer_params`, where its 4 leased chunks
    are; D (b) gets the request with those params unchanged, pulls the chunks (vLLM counts
    them as external prefix hits) and decodes the monolithic answer."""
    a, b, a_port = pair
    tokens = prompt(3)
    body = {"model": "smollm2", "prompt": tokens, "max_tokens": 1, "temperature": 0}
    answer, _ = post_json(a.url + "/v1/completions", {**body, "kv_transfer_params": TO_PREFILL})
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_port"] == a_port
    assert params["remote_num_tokens"] == 4 * CHUNK and len(params["remote_chunk_hashes"]) == 4
    before = external_hits(b)
    decoded, cached = complete(b, tokens, kv_transfer_params=params)
    assert external_hits(b) - before == 4 * CHUNK, b.log.read_text()[-3000:]
    # vLLM's D reports P's own cache hits as its cached_tokens (P adds them to its params)
    assert cached == params["remote_prefill_cached_tokens"] == 0
    assert decoded == complete(a, tokens)[0]


def test_malformed_params_are_a_warning_not_a_dead_engine(
    pair: tuple[VllmServer, VllmServer, int],
) -> None:
    """vLLM's server passes kv_transfer_params on unchecked: the plugin names what is wrong
    and computes; the engine serves on."""
    a, b, _ = pair
    tokens = prompt(4)
    answer, _ = complete(a, tokens)
    bad = {"kv_transfer_params": {"remote_kv_source": {"host": "127.0.0.1", "port": "x"}}}
    assert complete(b, tokens, **bad) == (answer, 0)
    assert "kv_transfer_params.remote_kv_source.port" in b.log.read_text()
    assert complete(b, tokens)[0] == answer


def test_a_returning_turn_loads_all_the_first_turn_computed_but_one_block(
    pair: tuple[VllmServer, VllmServer, int],
) -> None:
    """A chat's second turn: the first turn's prompt (4 chunks and 76 tokens), its 12-token
    answer and 40 new tokens. The first turn, finished, saved its 17th block as a tail (its
    blocks held until the workers copied it out: `request_finished` -> True, then
    `finished_sending`), so with vLLM's own cache emptied the second turn loads 17 blocks
    and computes 64 tokens, its new ones and the block they start in."""
    a, b, _ = pair
    events = Events(a)
    try:
        first = prompt(5, 1100)
        answer, _ = complete(a, first)
        turn = first + answer + prompt(6, 40)
        wait_until(
            lambda: any(len(e.block_hashes) == 1 for e in events.stored("CPU")),
            "the first turn's tail of one block in a's cpu tier",
        )
        # refused while blocks are held (the tail's, until copied): retried
        reset = a.url + "/reset_prefix_cache"
        wait_until(lambda: post_json(reset, {})[0]["success"], "vLLM's own cache emptied")
        before = external_hits(a)
        got, cached = complete(a, turn)
        assert cached == external_hits(a) - before == 17 * BLOCK
        assert len(turn) - cached == 64
        assert got == complete(b, turn)[0]  # b computes all of it
    finally:
        events.close()
