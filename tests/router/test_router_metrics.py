"""The router's /metrics keeps its labels bounded: a tier only an event stream names (any
medium string a publisher sends) is counted under tier="other", however many there are."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvconnect.events import BlockRemoved, BlockStored, KVEventBatch
from kvconnect.hashing import block_hashes, to_wire
from kvconnect.model.tokenizer import ByteTokenizer
from kvconnect.router.core import Router
from kvconnect.router.index import BlockIndex
from kvconnect.router.instances import Instance
from kvconnect.router.metrics import RouterMetrics

A = "http://127.0.0.1:1"
BS = 4
TOKENS = list(range(1, 9))  # 2 blocks


def samples(metrics: RouterMetrics, name: str) -> dict[str, float]:
    """`name`'s samples by their tier label."""
    text = metrics.render().decode()
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == name]
    return {s.labels["tier"]: s.value for s in family.samples if s.name.endswith("_total")}


def test_tiers_the_router_does_not_weigh_are_one_label_however_many_a_stream_names() -> None:
    index = BlockIndex(BS)
    router = Router([Instance(A, "tcp://127.0.0.1:2")], index, ByteTokenizer())
    metrics = RouterMetrics(router)
    hashes = [to_wire(h) for h in block_hashes(TOKENS, BS)]
    for i in range(300):  # a publisher naming a new medium in every batch
        stored = BlockStored(hashes, None, TOKENS, BS, None, f"MADE-UP-{i}", None)
        index.apply_batch(A, KVEventBatch(0.0, [stored], 0))
        router.record(A, router.scores(TOKENS)[A])
        index.apply_batch(A, KVEventBatch(0.0, [BlockRemoved(hashes, f"MADE-UP-{i}")], 0))
    stored = BlockStored(hashes, None, TOKENS, BS, None, "CPU", None)
    index.apply_batch(A, KVEventBatch(0.0, [stored], 0))
    router.record(A, router.scores(TOKENS)[A])
    assert samples(metrics, "kvconnect_router_hit_blocks") == {"other": 600, "CPU": 2}
    assert samples(metrics, "kvconnect_router_index_removed") == {"other": 600}
    index.check_integrity()
