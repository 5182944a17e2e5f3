"""A router index rebuilt at any time converges to the engine's truth: a router that starts
after the engine's history has left the replay ring, or loses batches, gets the instance's
state as a snapshot and then follows the stream."""

import random
import tempfile
import time

from kvconnect import LLM, SamplingParams
from kvconnect.hashing import to_wire
from kvconnect.router.index import BlockIndex
from kvconnect.stream.subscriber import KVEventSubscriber, ReceivedBatch, StreamSnapshot

rng = random.Random(21)
PREFIXES = [[rng.randrange(256) for _ in range(12)] for _ in range(3)]


def workload(llm: LLM, rounds: int) -> None:
    for _ in range(rounds):
        batch = [
            rng.choice(PREFIXES) + [rng.randrange(256) for _ in range(rng.randrange(1, 30))]
            for _ in range(4)
        ]
        llm.generate(batch, SamplingParams(max_tokens=rng.randrange(1, 6), ignore_eos=True))


def follow(index: BlockIndex, sub: KVEventSubscriber, llm: LLM, timeout: float = 10.0) -> None:
    """Apply what `sub` yields until it has reached the engine's last published seq."""
    last = llm.publisher.num_published - 1  # type: ignore[attr-defined]
    seen = -1
    deadline = time.monotonic() + timeout
    while seen < last:
        assert time.monotonic() < deadline, f"index reached seq {seen} of {last}"
        item = sub.recv(timeout=0.1)
        if item is None:
            continue
        index.apply_item("engine", item)
        if isinstance(item, ReceivedBatch | StreamSnapshot):
            seen = item.seq


def truth(llm: LLM) -> set[int | bytes]:
    return {to_wire(h) for h in llm.scheduler.pool.cached_hashes()}


def test_a_router_started_late_and_restarted_converges_to_the_engine() -> None:
    with tempfile.TemporaryDirectory() as d:
        ep, rp = f"ipc://{d}/ev", f"ipc://{d}/replay"
        cfg = {"enable_kv_cache_events": True, "endpoint": ep, "replay_endpoint": rp}
        cfg["buffer_steps"] = 4  # the ring forgets almost everything
        with LLM(
            "tiny", block_size=4, num_kv_blocks=40, kv_events_config=cfg, max_num_batched_tokens=64
        ) as llm:
            workload(llm, 8)  # many more batches than the ring holds
            assert llm.publisher.num_published > 20  # type: ignore[attr-defined]
            for generation in range(2):  # a router, then a restarted one
                index = BlockIndex(block_size=4)
                index.add_instance("engine")
                with KVEventSubscriber(ep, rp, start_seq=0, snapshots=True) as sub:
                    follow(index, sub, llm)
                    assert sub.num_snapshots == 1
                    assert index.blocks_of("engine", "GPU") == truth(llm), generation
                    workload(llm, 3)  # and it keeps following
                    follow(index, sub, llm)
                    assert index.blocks_of("engine", "GPU") == truth(llm), generation
                    assert index.stats.snapshots == 1 and not index.instances["engine"].stale
            # Without snapshots the index can only know what the ring still had.
            index = BlockIndex(block_size=4)
            index.add_instance("engine")
            with KVEventSubscriber(ep, rp, start_seq=0) as plain:
                follow(index, plain, llm)
            assert index.stats.gaps_lost == 1 and index.blocks_of("engine", "GPU") != truth(llm)
            llm.scheduler.check_integrity()
