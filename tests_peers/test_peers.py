"""vllm-router 0.1.17 and Dynamo's indexer 1.6.1 follow kvconnect's KV event streams.

Each test causes events on one kvconnect instance (serving a prompt, evicting it with new
prompts, resetting the engine), waits until this process has seen those exact events on the
wire, then asks both peers about the same tokens: Dynamo's `/query` (matched tokens per worker
and tier) and vllm-router's kv_aware decision (`probe`: routed, then refused by the instance,
so asking changes no cache). Before asking, each test waits until the peer has applied the
stream that far: vllm-router's log names each seq it applied, Dynamo's counters count each event.

Prompts are 80 token ids (5 blocks of 16); vllm-router is asked about the prompt plus 16 more
tokens, so all 80 can be credited (it credits only full blocks before a prompt's last token).
Dynamo answers matched tokens per tier cumulatively: `cpu` is matched in GPU or host memory,
`disk` in any tier; its `scores` are GPU matches.

Setup and networking: conftest.py.
"""

from __future__ import annotations

import itertools

import pytest

from tests_peers.instances import Instance
from tests_peers.lab import Lab
from tests_peers.peers import VllmRouter, tiers
from tests_peers.support import BLOCK_SIZE, prompt

pytestmark = pytest.mark.slow

# A local tier holds all 80: the 64-token chunk, and the tail the finished request saved (its
# 5th block). Redis keeps whole chunks only: 64.
CPU_CREDIT = int(80 * VllmRouter.CREDIT["host"])
DISK_CREDIT = int(80 * VllmRouter.CREDIT["disk"])
REDIS_CREDIT = int(64 * VllmRouter.CREDIT["disk"])  # vllm-router files STORAGE as disk
GPU_80 = {"longest_matched": 80, "gpu": 80, "cpu": 80, "disk": 80}
NOTHING = {"longest_matched": 0, "gpu": 0, "cpu": 0, "disk": 0}

_floods = itertools.count()


def tail(tag: str) -> list[int]:
    return prompt(f"{tag}-tail", BLOCK_SIZE)


def evict(lab: Lab, inst: Instance, hashes: list[int]) -> int:
    """Serve new prompts on `inst` until its stream says that none of `hashes` is in its GPU
    blocks any more (16 blocks, LRU); the last seq of the stream then."""
    for _ in range(20):
        held = lab.streams.held(inst.name, "GPU")
        if not any(held[h] for h in hashes):
            return int(lab.streams.last_seq(inst.name))
        flood = prompt(f"flood-{inst.name}-{next(_floods)}")
        mark = lab.streams.last_seq(inst.name)
        inst.complete(flood)
        lab.streams.stored(inst.name, flood, after=mark)
    pytest.fail(f"{inst.name}: 20 new prompts did not evict {hashes}")


def test_a_stored_prompt_is_credited_to_its_instance_by_both_peers(lab: Lab) -> None:
    a = lab.dynamo_id("a")
    p = prompt("stored")
    lab.a.complete(p)
    stored = lab.streams.stored("a", p)
    assert len(stored.hashes) == 5 and stored.parent is None

    lab.dynamo_caught_up()
    answer = lab.dynamo.query(p)
    assert tiers(answer, a) == GPU_80
    assert answer["scores"] == {str(a): {"0": 80}}  # no other worker's

    lab.router.wait_applied(lab.a.url, stored.seq)
    decision, usage = lab.router.complete(p + tail("stored"))
    assert (decision.worker, decision.credited_prefix_tokens) == (lab.a.url, 80)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 80  # and A had them


def test_an_extension_is_linked_to_its_prefix_by_the_parent_hash(lab: Lab) -> None:
    p, more = prompt("extended"), prompt("extended-more", 2 * BLOCK_SIZE)
    lab.a.complete(p)
    first = lab.streams.stored("a", p)
    usage = lab.a.complete(p + more)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 80
    extension = lab.streams.stored("a", more, after=first.seq)
    assert len(extension.hashes) == 2 and extension.parent == first.hashes[-1]

    # Dynamo hashes the tokens of an event itself; it finds the chain's start by parent hash.
    lab.dynamo_caught_up()
    assert tiers(lab.dynamo.query(p + more), lab.dynamo_id("a"))["gpu"] == 112

    lab.router.wait_applied(lab.a.url, extension.seq)
    decision = lab.router.probe(p + more + tail("extended"))
    assert (decision.worker, decision.credited_prefix_tokens) == (lab.a.url, 112)


def test_evicted_blocks_are_no_longer_credited(lab: Lab) -> None:
    a = lab.dynamo_id("a")
    p = prompt("evicted")
    lab.a.complete(p)
    stored = lab.streams.stored("a", p)
    lab.dynamo_caught_up()
    assert tiers(lab.dynamo.query(p), a) == GPU_80
    lab.router.wait_applied(lab.a.url, stored.seq)
    before = lab.router.probe(p + tail("evicted"))
    assert (before.worker, before.credited_prefix_tokens) == (lab.a.url, 80)

    seq = evict(lab, lab.a, stored.hashes)

    lab.dynamo_caught_up()
    assert tiers(lab.dynamo.query(p), a) == NOTHING
    lab.router.wait_applied(lab.a.url, seq)
    assert lab.router.probe(p + tail("evicted")).credited_prefix_tokens == 0


def test_all_blocks_cleared_empties_both_peers_view_of_an_engine(lab: Lab) -> None:
    engine = lab.dynamo_id("engine")
    p = prompt("cleared")
    lab.engine.generate(p)
    stored = lab.streams.stored("engine", p)
    lab.dynamo_caught_up()
    assert tiers(lab.dynamo.query(p), engine) == GPU_80
    lab.router.wait_applied(lab.engine_url, stored.seq)
    before = lab.router.probe(p + tail("cleared"))
    assert (before.worker, before.credited_prefix_tokens) == (lab.engine_url, 80)

    lab.engine.reset()
    cleared = lab.streams.event("engine", "AllBlocksCleared", after=stored.seq)

    lab.dynamo_caught_up()
    assert tiers(lab.dynamo.query(p), engine) == NOTHING
    lab.router.wait_applied(lab.engine_url, cleared)
    assert lab.router.probe(p + tail("cleared")).credited_prefix_tokens == 0


def test_blocks_in_the_cpu_tier_get_host_credit_not_gpu_credit(lab: Lab) -> None:
    c = lab.dynamo_id("c")
    p = prompt("cpu-tier")
    lab.c.complete(p)
    gpu = lab.streams.stored("c", p)
    cpu = lab.streams.stored("c", p[:64], medium="CPU")  # the tier stores 64-token chunks
    assert cpu.hashes == gpu.hashes[:4]

    seq = evict(lab, lab.c, gpu.hashes)
    held = lab.streams.held("c", "CPU")
    assert all(held[h] == 1 for h in cpu.hashes)  # still in the tier

    lab.dynamo_caught_up()
    answer = lab.dynamo.query(p)
    assert tiers(answer, c) == {"longest_matched": 80, "gpu": 0, "cpu": 80, "disk": 80}
    assert answer["scores"] == {}

    lab.router.wait_applied(lab.c.url, seq)
    decision = lab.router.probe(p + tail("cpu-tier"))
    assert (decision.worker, decision.credited_prefix_tokens) == (lab.c.url, CPU_CREDIT)


def test_blocks_on_the_disk_tier_get_disk_credit_not_gpu_credit(lab: Lab) -> None:
    d = lab.dynamo_id("d")
    p = prompt("disk-tier")
    lab.d.complete(p)
    gpu = lab.streams.stored("d", p)
    disk = lab.streams.stored("d", p[:64], medium=None)  # any tier but GPU: the disk
    assert disk.hashes == gpu.hashes[:4]

    seq = evict(lab, lab.d, gpu.hashes)

    lab.dynamo_caught_up()
    assert tiers(lab.dynamo.query(p), d) == {"longest_matched": 80, "gpu": 0, "cpu": 0, "disk": 80}

    lab.router.wait_applied(lab.d.url, seq)
    decision = lab.router.probe(p + tail("disk-tier"))
    assert (decision.worker, decision.credited_prefix_tokens) == (lab.d.url, DISK_CREDIT)


def test_blocks_in_a_redis_tier_get_tier_credit_not_gpu_credit(lab: Lab) -> None:
    """The redis tier says STORAGE/REMOTE (vLLM 0.33). Its older EXTERNAL was a medium that
    vllm-router does not know: it filed those blocks as GPU blocks, and the GPU's BlockRemoved
    took them away again (credit 0 once evicted from GPU, full GPU credit before)."""
    r = lab.dynamo_id("r")
    p = prompt("redis-tier")
    lab.r.complete(p)
    gpu = lab.streams.stored("r", p)
    redis = lab.streams.stored("r", p[:64], medium=None)  # any tier but GPU: Redis
    assert redis.hashes == gpu.hashes[:4]

    seq = evict(lab, lab.r, gpu.hashes)

    # Dynamo 1.6.1 drops every event whose locality is REMOTE (a shared store is no worker's
    # own), silently: so with the GPU copies gone it credits R nothing, in no tier.
    lab.dynamo_caught_up()
    assert tiers(lab.dynamo.query(p), r) == NOTHING

    # vllm-router reads the medium and not the locality: STORAGE is its disk tier.
    lab.router.wait_applied(lab.r.url, seq)
    decision = lab.router.probe(p + tail("redis-tier"))
    assert (decision.worker, decision.credited_prefix_tokens) == (lab.r.url, REDIS_CREDIT)


def test_the_tiers_are_announced_in_vllm_033s_vocabulary(lab: Lab) -> None:
    """medium and locality as vLLM 0.33 names them (issue 24, item 1)."""
    p = prompt("vocabulary")
    for inst in (lab.c, lab.d, lab.r):
        inst.complete(p)
    said = {
        name: (event["medium"], event.get("locality"))
        for name in ("c", "d", "r")
        for event in [lab.streams.stored(name, p[:64], medium=None).event]
    }
    assert said == {"c": ("CPU", None), "d": ("STORAGE", "LOCAL"), "r": ("STORAGE", "REMOTE")}


def test_dynamo_applied_every_event_of_the_session_without_fault(lab: Lab) -> None:
    """Runs last: by Dynamo's own counters, every GPU store, removal and clear of every stream
    applied, none with a fault (an unknown parent or block) or a duplicate store."""
    lab.dynamo_caught_up()
    assert lab.dynamo.faults() == {}
