"""Peer pulls (issue 32, item 1, on kvconnect's own engine): two real `kvconnect serve`
processes with a cpu tier and a peer config. A request to B that names A as its
`kv_transfer_params.remote_kv_source` pulls the prompt's chunks A holds, checked before a byte
reaches B's cache, and computes the rest; B then holds them (its cpu tier announces them).

    A answers the prompt                     A's cpu tier stores its 4 chunks of 32
    B, remote_kv_source A                    cached_tokens 128 (pulled), A's answer
    B, a peer not in its sources             a 400 naming the key; A is never contacted
    B, a source that never answers           1 s (timeout_s), then computed: the same answer
    B, a source that serves other chunks     refused (integrity), computed: the same answer
    P/D: A with do_remote_decode, max_tokens 1   its answer names its peer port and chunks
         B with A's answer's params              pulls them (cached_tokens 128), A's answer;
                                                 A's lease is released
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import pytest
import torch

from kvconnect.connector.offload.common import ChunkInfo
from kvconnect.connector.offload.tiers.base import pack
from kvconnect.events import BlockStored
from kvconnect.router.pd import TO_PREFILL
from kvconnect.stream.subscriber import KVEventSubscriber, ReceivedBatch
from tests.helpers import free_port, wait_for
from tests.peer_fakes import CHUNK, Reply, answer_of, fake_peer, hello_of, peer_config, prompt
from tests.serving import Serve, get, post

pytestmark = pytest.mark.slow


class Pair(NamedTuple):
    a: Serve
    b: Serve
    a_port: int
    """A's peer port: one of B's sources."""
    impostors: list[int]
    """More of B's sources, for the tests' own servers that play a peer: one a test (B backs
    off from a source that did not answer, for a while)."""


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    tmp = tmp_path_factory.mktemp("peer-pull")
    a_port, impostors = free_port(), [free_port() for _ in range(4)]
    details = "--enable-prompt-tokens-details"
    a = Serve(tmp, "--kv-transfer-config", peer_config(a_port), details)
    b = Serve(tmp, "--kv-transfer-config", peer_config(free_port(), (a_port, *impostors)), details)
    a.start()
    try:
        b.start()
        try:
            yield Pair(a, b, a_port, impostors)
        finally:
            assert b.stop() == 0, b.logs()
    finally:
        assert a.stop() == 0, a.logs()


def metric(server: Serve, name: str) -> float:
    status, text = get(server.url + "/metrics")
    assert status == 200, text
    found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def complete(server: Serve, tokens: list[int], **extra: Any) -> tuple[str, int]:
    status, body, _ = post(
        server.url + "/v1/completions",
        {"model": "tiny", "prompt": tokens, "max_tokens": 8, "temperature": 0, **extra},
    )
    assert status == 200, body
    usage = body["usage"]
    return body["choices"][0]["text"], usage["prompt_tokens_details"]["cached_tokens"]


def source(port: int, host: str = "127.0.0.1") -> dict[str, Any]:
    return {"kv_transfer_params": {"remote_kv_source": {"host": host, "port": port}}}


def stored_on(server: Serve, chunks: float) -> None:
    wait_for(
        lambda: metric(server, "kvconnect_connector_num_chunks_stored_total") >= chunks,
        timeout=30,
        what=f"{chunks} chunks stored",
    )


def cpu_chunks(sub: KVEventSubscriber, want: int, gpu: set[Any] | None = None) -> list[Any]:
    """The last block hashes of the chunks `sub`'s instance announces in its cpu tier, read
    until there are `want`; the block hashes it announces in its engine cache (GPU) meanwhile
    go into `gpu`."""
    seen: list[Any] = []
    deadline = time.monotonic() + 30
    while len(seen) < want:
        assert time.monotonic() < deadline, f"only {seen} announced"
        item = sub.recv(timeout=0.5)
        if isinstance(item, ReceivedBatch):
            for e in item.batch.events:
                if isinstance(e, BlockStored) and e.medium == "CPU":
                    seen.append(e.block_hashes[-1])
                elif isinstance(e, BlockStored) and gpu is not None:
                    gpu.update(e.block_hashes)
    return seen


def test_a_request_naming_a_peer_pulls_the_prefix_it_holds(
    pair: Pair,
) -> None:
    """B pulls A's 4 chunks (A's answer, cached_tokens 128), then holds them in its own cpu
    tier and announces them there: the same chunks (block hashes) as A announced."""
    a, b, a_port, _ = pair
    tokens = prompt(1)
    a_sub = KVEventSubscriber(*a.instance.split(",")[1:], start_seq=0)
    b_sub = KVEventSubscriber(*b.instance.split(",")[1:], start_seq=0)
    try:
        text, cached = complete(a, tokens)
        assert cached == 0
        a_chunks = cpu_chunks(a_sub, 4)
        pulled, cached = complete(b, tokens, **source(a_port))
        assert (pulled, cached) == (text, 4 * CHUNK)
        b_gpu: set[Any] = set()
        assert cpu_chunks(b_sub, 4, b_gpu) == a_chunks
        # B's engine cache holds the pulled blocks too, and says so (GPU, vLLM's medium for
        # the engine's cache): every chunk's blocks
        deadline = time.monotonic() + 30
        while not set(a_chunks) <= b_gpu:
            assert time.monotonic() < deadline, f"B announced {b_gpu} in its cache"
            item = b_sub.recv(timeout=0.5)
            if isinstance(item, ReceivedBatch):
                b_gpu.update(
                    h
                    for e in item.batch.events
                    if isinstance(e, BlockStored) and e.medium == "GPU"
                    for h in e.block_hashes
                )
    finally:
        a_sub.close()
        b_sub.close()
    assert metric(b, "kvconnect_connector_peer_hits_total") == 4
    complete(a, [1, 2, 3])  # A's workers report their counts with a step's output
    assert metric(a, "kvconnect_connector_peer_chunks_served_total") == 4


@pytest.mark.parametrize(
    "named",
    [
        {"remote_kv_source": {"host": "localhost", "port": "A"}},  # A's port, not as listed
        {"remote_kv_source": {"host": "127.0.0.1", "port": "B's HTTP"}},
        {"remote_kv_source": {"host": "127.0.0.1", "port": 1}},
        {
            "do_remote_prefill": True,
            "remote_host": "127.0.0.1",
            "remote_port": "B's HTTP",
            "remote_chunk_hashes": ["00" * 32],
        },
    ],
)
def test_a_peer_that_is_not_configured_is_a_400_naming_the_key_and_never_contacted(
    pair: Pair, named: dict[str, Any]
) -> None:
    """Only B's configured peers (`peer.sources`, HOST:PORT as listed) may be named: another
    host for A, any other port of a listed host (B's own HTTP port), or a P/D prefill that is
    not a peer is refused before anything runs, and A is never asked."""
    a, b, a_port, _ = pair
    tokens = prompt(2)
    complete(a, tokens)
    stored_on(a, 1)
    served = metric(a, "kvconnect_connector_peer_chunks_served_total")
    ports = {"A": a_port, "B's HTTP": int(b.url.rsplit(":", 1)[1])}
    params = json.loads(json.dumps(named))
    where = params.get("remote_kv_source", params)
    key = "port" if "remote_kv_source" in params else "remote_port"
    where[key] = ports.get(where[key], where[key])
    status, body, _ = post(
        b.url + "/v1/completions",
        {"model": "tiny", "prompt": tokens, "max_tokens": 1, "kv_transfer_params": params},
    )
    assert status == 400, body
    assert body["error"]["param"] == "kv_transfer_params"
    assert "is not one of this instance's peers" in body["error"]["message"]
    assert f"127.0.0.1:{a_port}" in body["error"]["message"]  # the peers it may name
    complete(a, [1, 2, 3])  # A's workers report their counts with a step's output
    assert metric(a, "kvconnect_connector_peer_chunks_served_total") == served


def test_a_silent_source_costs_its_timeout_then_the_prompt_is_computed(
    pair: Pair,
) -> None:
    a, b, _, impostors = pair
    impostor = impostors[0]
    tokens = prompt(3)
    text, _ = complete(a, tokens)
    with socket.socket() as silent:  # takes connections, never answers
        silent.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # its last test's
        silent.bind(("127.0.0.1", impostor))
        silent.listen()
        assert complete(b, tokens, **source(impostor)) == (text, 0)


def forged(key: bytes) -> list[bytes]:
    """A chunk named as asked (its checksum right) but of other tokens."""
    other = ChunkInfo(b"x" * 32, (1, 2), None, tuple(range(32)), 16)
    return [bytes(p) for p in pack(key.decode(), other, torch.zeros(2))]


def test_a_source_that_serves_another_prompts_chunks_is_refused(pair: Pair) -> None:
    """A peer of the test, configured as one of B's sources, greets as A does (A's model),
    says it holds everything and answers every key with a chunk named as asked (its checksum
    right) but of other tokens: B's checks refuse each, B computes, and its answer is A's."""
    a, b, a_port, impostors = pair
    impostor = impostors[1]
    tokens = prompt(4)
    text, _ = complete(a, tokens)
    served: list[bytes] = []

    def forge(verb: bytes, arg: bytes) -> Reply:
        if verb == b"S":  # HAS: all of them
            return answer_of(msgspec.msgpack.encode(len(msgspec.msgpack.decode(arg))))
        served.append(arg)
        return answer_of(*forged(arg))

    refused = metric(b, "kvconnect_connector_num_peer_integrity_misses_total")
    with fake_peer(forge, hello=hello_of(a_port), port=impostor):
        assert complete(b, tokens, **source(impostor)) == (text, 0)
    assert len(served) == 4
    assert metric(b, "kvconnect_connector_num_peer_integrity_misses_total") == refused + 4
    assert "its token ids differ" in b.logs()


def prefill(server: Serve, tokens: list[int]) -> dict[str, Any]:
    """Step 1 of the handshake, as the toy proxy sends it: P's answer's kv_transfer_params."""
    status, body, _ = post(
        server.url + "/v1/completions",
        {
            "model": "tiny",
            "prompt": tokens,
            "max_tokens": 1,
            "temperature": 0,
            "stream": False,
            "kv_transfer_params": TO_PREFILL,
        },
    )
    assert status == 200, body
    params: dict[str, Any] = body["kv_transfer_params"]
    return params


def test_pd_in_nixl_connectors_handshake(pair: Pair) -> None:
    """P answers `do_remote_decode` with NixlConnector's keys naming its peer port and the 4
    chunks it leased; D, given them unchanged (at once: P's stores may still be on their
    way), pulls the 4 chunks and decodes: P's own answer to the whole request. D then
    releases P's lease."""
    a, b, a_port, _ = pair
    tokens = prompt(7)
    released = metric(a, "kvconnect_connector_num_leases_released_total")
    params = prefill(a, tokens)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", a_port)
    assert params["remote_num_tokens"] == 4 * CHUNK and len(params["remote_chunk_hashes"]) == 4
    assert params["tp_size"] == 1 and params["remote_engine_id"]
    assert params["remote_blocks_expiry_time"] > time.time() + 20  # the 30 s lease
    decoded = complete(b, tokens, kv_transfer_params=params)
    assert decoded == (complete(a, tokens)[0], 4 * CHUNK)

    def lease_released() -> bool:
        complete(a, [1, 2, 3])  # A's workers report their counts with a step's output
        return metric(a, "kvconnect_connector_num_leases_released_total") == released + 1

    wait_for(lease_released, timeout=30, what="P's lease released by D")
    assert metric(a, "kvconnect_connector_num_leases_granted_total") >= 1


def test_pd_from_a_prefill_of_another_prompt_or_a_dead_one_computes(
    pair: Pair,
) -> None:
    """D given a prefill's params for another prompt names the mismatch and computes; D given
    params naming a prefill that never answers computes after its timeout. The same answer
    either way."""
    a, b, _, impostors = pair
    impostor = impostors[2]
    tokens = prompt(8)
    text, _ = complete(a, tokens)
    other = prefill(a, prompt(9))
    assert complete(b, tokens, kv_transfer_params=other) == (text, 0)
    assert "leased other chunks than this prompt's" in b.logs()
    tokens = prompt(10)
    text, _ = complete(a, tokens)
    with socket.socket() as silent:
        port = impostor
        silent.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        silent.bind(("127.0.0.1", port))
        silent.listen()
        dead = {**prefill(a, tokens), "remote_port": port}
        start = time.monotonic()
        assert complete(b, tokens, kv_transfer_params=dead) == (text, 0)
        assert time.monotonic() - start >= 1.0  # it was asked: B waited its timeout_s
    assert f"peer 127.0.0.1:{port} lookup failed" in b.logs()


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"do_remote_prefill": True, "remote_port": 7000}, "remote_host"),
        ({"do_remote_prefill": True, "remote_host": "h", "remote_port": 0}, "remote_port"),
        (
            {
                "do_remote_decode": True,
                "do_remote_prefill": True,
                "remote_host": "h",
                "remote_port": 1,
            },
            "exclusive",
        ),
        (
            {
                "do_remote_prefill": True,
                "remote_host": "h",
                "remote_port": 1,
                "remote_chunk_hashes": ["xyz"],
            },
            "remote_chunk_hashes",
        ),
        ({"do_remote_decode": True, "dcp_size": 1}, "dcp_size"),
    ],
)
def test_malformed_pd_params_are_a_400_naming_what(
    pair: Pair, params: dict[str, Any], named: str
) -> None:
    b = pair.b
    status, body, _ = post(
        b.url + "/v1/completions",
        {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1, "kv_transfer_params": params},
    )
    assert status == 400, body
    assert named in body["error"]["message"], body


@pytest.mark.heavy
def test_every_rank_pulls_its_own_shard_and_another_tp_size_is_refused(
    tmp_path: Path,
) -> None:
    """TP 2 on both sides: each rank pulls from the same rank of the source (port + rank), and
    the answer is the source's. An instance of TP 1 naming the same source is refused with a
    line naming both sizes, and computes."""
    a_port = free_port(2)  # rank 1 serves on rank 0's port + 1
    tp2 = ("--tp", "2", "--distributed-executor-backend", "mp")
    details = "--enable-prompt-tokens-details"
    a = Serve(tmp_path, *tp2, "--kv-transfer-config", peer_config(a_port), details)
    b = Serve(tmp_path, *tp2, "--kv-transfer-config", peer_config(free_port(2), (a_port,)), details)
    c = Serve(tmp_path, "--kv-transfer-config", peer_config(free_port(), (a_port,)), details)
    servers = [a, b, c]
    try:
        for s in servers:
            s.start()
        tokens = prompt(6)
        text, _ = complete(a, tokens)
        stored_on(a, 8)  # 4 chunks on each of 2 ranks
        assert complete(b, tokens, **source(a_port)) == (text, 4 * CHUNK)
        assert metric(b, "kvconnect_connector_peer_hits_total") == 8
        assert complete(c, tokens, **source(a_port)) == (text, 0)
        assert "runs tensor-parallel size 2, this instance 1: equal TP sizes only" in c.logs()
    finally:
        for s in servers:
            if s.proc is not None:
                assert s.stop() == 0, s.logs()


def test_usage_and_metrics_say_where_the_cached_tokens_came_from(pair: Pair) -> None:
    """A pulled prefix is `p2p` in the answer's usage and in vLLM's metric
    `vllm:prompt_tokens_cached_by_source`; the same prompt again is the engine's own
    (`device`)."""
    a, b, a_port, _ = pair
    tokens = prompt(11)
    stored = metric(a, "kvconnect_connector_num_chunks_stored_total")
    complete(a, tokens)
    stored_on(a, stored + 4)

    def by_source(server: Serve, **extra: Any) -> dict[str, int]:
        status, body, _ = post(
            server.url + "/v1/completions",
            {"model": "tiny", "prompt": tokens, "max_tokens": 1, **extra},
        )
        assert status == 200, body
        found: dict[str, int] = body["usage"]["prompt_tokens_details"]["cached_tokens_by_source"]
        return found

    before = metric(b, 'vllm:prompt_tokens_cached_by_source_total{model_name="tiny",source="p2p"}')
    assert by_source(b, **source(a_port)) == {"p2p": 4 * CHUNK}
    assert by_source(b) == {"device": 144}
    after = metric(b, 'vllm:prompt_tokens_cached_by_source_total{model_name="tiny",source="p2p"}')
    assert after - before == 4 * CHUNK


def test_pulls_that_fill_the_kv_pool_all_answer(pair: Pair, tmp_path: Path) -> None:
    """Five requests pull one prefix at once into an instance whose KV pool their loads fill
    (8 blocks each, 40 in all); back from the loads, each needs 2 blocks more. They all
    answer, with A's text (the instance used to wait for ever, answering nothing more)."""
    a, _, a_port, _ = pair
    tokens = prompt(11)
    text, _ = complete(a, tokens)
    stored_on(a, 4)
    c = Serve(
        tmp_path, "--num-kv-blocks", "40", "--enable-prompt-tokens-details",
        "--kv-transfer-config", peer_config(free_port(), (a_port,)),
    )  # fmt: skip
    c.start()
    try:
        with ThreadPoolExecutor(5) as pool:
            answers = list(pool.map(lambda _: complete(c, tokens, **source(a_port)), range(5)))
        assert [t for t, _ in answers] == [text] * 5
        assert complete(c, prompt(12))[1] == 0  # and it serves the next one
    finally:
        assert c.stop() == 0, c.logs()
