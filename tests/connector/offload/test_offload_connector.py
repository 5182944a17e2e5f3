"""The offload connector's two halves driven in-process in vLLM's step order, with real tiers
and real KV tensors; two TP ranks share nothing but the metadata that crosses the boundary."""

import contextlib
import logging
import random
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import zmq.auth

from kvconnect.config import KVTransferConfig
from kvconnect.connector import (
    KVConnectorContext,
    KVConnectorFactory,
    KVConnectorOutput,
    KVConnectorRole,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)
from kvconnect.connector.aggregator import KVOutputAggregator
from kvconnect.connector.offload.common import OffloadWorkerMetadata
from kvconnect.connector.offload.connector import OffloadConnector
from kvconnect.connector.offload.peers.protocol import Hello
from kvconnect.connector.step import run_worker_step
from kvconnect.engine.request import RequestStatus
from kvconnect.events import MEDIUMS, BlockRemoved, BlockStored, tier_of
from kvconnect.hashing import block_hashes
from tests.connector.helpers import roundtrip
from tests.engine.test_scheduler import BS
from tests.helpers import free_port, wait_for
from tests.peer_fakes import Reply, answer_of, fake_peer

CHUNK = 8  # two blocks of 4


class Loop:
    def __init__(
        self,
        tiers: list[dict[str, Any]],
        world_size: int = 2,
        peer: dict[str, Any] | None = None,
    ) -> None:
        extra: dict[str, Any] = {"chunk_size": CHUNK, "tiers": tiers}
        if peer is not None:
            extra["peer"] = peer
        cfg = KVTransferConfig(
            kv_connector="OffloadConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )

        def make(rank: int, role: KVConnectorRole) -> OffloadConnector:
            ctx = KVConnectorContext(
                cfg, world_size=world_size, rank=rank, block_size=BS, model_name="m"
            )
            c = KVConnectorFactory.create_connector(ctx, role)
            assert isinstance(c, OffloadConnector)
            return c

        self.sched = make(0, KVConnectorRole.SCHEDULER)
        self.workers = [make(r, KVConnectorRole.WORKER) for r in range(world_size)]
        gen = torch.Generator().manual_seed(0)
        self.caches = [
            {f"layer{i}": torch.randn(2, 64, BS, 2, 4, generator=gen) for i in range(2)}
            for _ in range(world_size)
        ]
        for w, caches in zip(self.workers, self.caches, strict=True):
            w.register_kv_caches(caches)
        self.aggregator = KVOutputAggregator(world_size)
        self.events: list[Any] = []
        self.next_block = 0
        self.finished_recving: set[str] = set()
        self.finished_sending: set[str] = set()
        self.invalid: set[int] = set()

    def blocks(self, n: int) -> list[int]:
        ids = [(self.next_block + i) % 64 for i in range(n)]
        self.next_block += n
        return ids

    def step(self, new: list[tuple[str, list[int], list[int]]] = ()) -> None:  # type: ignore[assignment]
        """One step. Each worker's I/O thread first finishes what earlier steps queued, and
        the forward pass waits for this step's loads, so what a step reports is exact."""
        out = SchedulerOutput()
        for rid, tokens, ids in new:
            hashes = block_hashes(tokens, BS)
            out.scheduled_new_reqs.append(NewRequestData(rid, tokens, hashes, ids))
            out.scheduled.append(ScheduledRequest(rid, tokens, 0, ids, sample=True))
        meta = self.sched.build_connector_meta(out)
        outputs: list[KVConnectorOutput | None] = []
        for w in self.workers:
            assert w.worker is not None
            assert w.worker.drain()
            _, output = run_worker_step(
                w, roundtrip(meta), set(), lambda _hooks, io=w.worker: io.drain()
            )
            outputs.append(roundtrip(output))
        agg = self.aggregator.aggregate(outputs)
        self.finished_recving |= agg.finished_recving or set()
        self.finished_sending |= agg.finished_sending or set()
        self.invalid |= agg.invalid_block_ids
        self.sched.update_connector_output(agg)
        self.events += self.sched.take_events()

    def remote_hit(self, req: "Req") -> list[int]:
        """Once its source has answered the lookup: `req`'s 16 tokens (2 chunks) to load
        asynchronously, into 6 new blocks (returned)."""
        wait_for(lambda: self.sched.get_num_new_matched_tokens(req, 0) != (None, False))
        assert self.sched.get_num_new_matched_tokens(req, 0) == (16, True)
        dst = self.blocks(6)
        self.sched.update_state_after_alloc(req, dst, 16)
        return dst

    def shutdown(self) -> None:
        for w in self.workers:
            w.shutdown()


class Req:
    def __init__(self, rid: str, tokens: list[int], params: dict[str, Any] | None = None) -> None:
        self.request_id, self.all_token_ids = rid, tokens
        self.block_hashes = block_hashes(tokens, BS)
        self.kv_transfer_params = params
        self.cache_salt = None
        self.status = RequestStatus.FINISHED_LENGTH


def held_by_events(events: list[Any]) -> dict[str, Counter[int | bytes]]:
    """Chunks held per tier label ("CPU", "STORAGE/LOCAL"), by what the events say."""
    tiers: dict[str, Counter[int | bytes]] = {}
    for ev in events:
        if isinstance(ev, BlockStored | BlockRemoved):
            assert ev.medium in MEDIUMS, ev.medium  # vLLM 0.33's words, not DISK or EXTERNAL
            held = tiers.setdefault(tier_of(ev.medium, ev.locality), Counter())
            held[ev.block_hashes[-1]] += 1 if isinstance(ev, BlockStored) else -1
        if isinstance(ev, BlockStored):
            assert len(ev.token_ids) == CHUNK and ev.block_size == BS
    return {t: +c for t, c in tiers.items()}


def test_events_equal_each_tiers_contents_after_a_random_workload(tmp_path: Path) -> None:
    loop = Loop(
        [
            {"kind": "cpu", "max_bytes": 3 * 2 * 2 * CHUNK * 2 * 4 * 4},
            {"kind": "disk", "path": str(tmp_path), "max_bytes": 9000},
        ]
    )
    rng = random.Random(2)
    prefixes = [[rng.randrange(256) for _ in range(CHUNK)] for _ in range(4)]
    try:
        for i in range(40):
            tokens = rng.choice(prefixes) + [
                rng.randrange(256) for _ in range(rng.choice([0, 8, 17]))
            ]
            loop.step([(f"r{i}", tokens, loop.blocks(-(-len(tokens) // BS)))])
        loop.step()
        held = held_by_events(loop.events)
        assert set(held) == {"CPU", "STORAGE/LOCAL"}
        assert held["STORAGE/LOCAL"], "the workload should have demoted chunks to disk"
        assert any(
            isinstance(e, BlockRemoved) and (e.medium, e.locality) == ("STORAGE", "LOCAL")
            for e in loop.events
        )
        for w in loop.workers:
            assert w.worker is not None
            for tier in w.worker.tiers:
                actual = Counter(info.block_hashes[-1] for _, info in tier.entries())
                assert actual == held.get(tier.kind.tier, Counter()), tier.kind.tier
        assert loop.sched.scheduler is not None
        quorum = loop.sched.scheduler.quorum
        assert quorum.num_pending == 0 and quorum.num_expired == 0
        quorum.check_integrity()
    finally:
        loop.shutdown()


def test_load_writes_the_saved_kv_back_into_new_blocks(tmp_path: Path) -> None:
    loop = Loop([{"kind": "disk", "path": str(tmp_path), "max_bytes": 1 << 20}])
    tokens = list(range(40, 61))  # 21 tokens: chunks 0 and 1 (16 tokens), 5 tokens left
    try:
        src = loop.blocks(6)
        loop.step([("a", tokens, src)])
        loop.step()
        req = Req("b", tokens)
        assert loop.sched.get_num_new_matched_tokens(req, 4) == (12, True)  # 1 block on GPU
        dst = loop.blocks(6)
        loop.sched.update_state_after_alloc(req, dst, 12)
        loop.step()
        assert loop.finished_recving == {"b"} and loop.invalid == set()
        for caches in loop.caches:
            for layer in caches.values():
                assert torch.equal(layer[:, dst[1:4]], layer[:, src[1:4]])  # loaded blocks
                assert not torch.equal(layer[:, dst[0]], layer[:, src[0]])  # left alone
    finally:
        loop.shutdown()


def test_the_last_chunk_loads_in_part_up_to_the_last_prompt_token() -> None:
    """A hit ends where the engine's own prefix cache would end it: on the last whole block
    before the last prompt token, inside the last chunk if need be (here 20 tokens, not 16)."""
    loop = Loop([{"kind": "cpu", "max_bytes": 1 << 20}])
    tokens = list(range(40, 64))  # 24 tokens: 3 whole chunks stored
    try:
        src = loop.blocks(6)
        loop.step([("a", tokens, src)])
        loop.step()
        req = Req("b", tokens)
        # all in the cpu tier: a sync load (done before the step's forward, not reported)
        assert loop.sched.get_num_new_matched_tokens(req, 0) == (20, False)
        dst = loop.blocks(5)  # what the engine allocates for 20 tokens
        loop.sched.update_state_after_alloc(req, dst, 20)
        loop.step()
        assert loop.finished_recving == set() and loop.invalid == set()
        for caches in loop.caches:
            for layer in caches.values():
                assert torch.equal(layer[:, dst], layer[:, src[:5]])
        assert loop.sched.get_num_new_matched_tokens(Req("c", tokens[:23]), 0) == (16, False)
    finally:
        loop.shutdown()


def test_a_chunk_missing_on_one_rank_is_a_load_error(tmp_path: Path) -> None:
    loop = Loop([{"kind": "cpu", "max_bytes": 1 << 20}])
    tokens = list(range(9))
    try:
        ids = loop.blocks(3)
        loop.step([("a", tokens, ids)])
        loop.step()
        assert loop.workers[1].worker is not None
        loop.workers[1].worker.tiers[0].clear()  # rank 1 lost it behind the scheduler's back
        req = Req("b", tokens)
        assert loop.sched.get_num_new_matched_tokens(req, 0) == (8, False)  # a sync load
        dst = loop.blocks(3)
        loop.sched.update_state_after_alloc(req, dst, 8)
        loop.step()
        assert loop.finished_recving == set() and loop.invalid == set(dst[:2])
    finally:
        loop.shutdown()


def test_a_disk_hit_is_promoted_back_into_the_cpu_tier(tmp_path: Path) -> None:
    one_chunk = 2 * 2 * CHUNK * 2 * 4 * 4  # layers * K/V * tokens * heads * dim * 4 bytes
    loop = Loop(
        [
            {"kind": "cpu", "max_bytes": one_chunk},
            {"kind": "disk", "path": str(tmp_path), "max_bytes": 1 << 20},
        ],
        world_size=1,
    )
    a, b = list(range(9)), list(range(100, 109))
    try:
        loop.step([("a", a, loop.blocks(3))])
        loop.step([("b", b, loop.blocks(3))])  # a's chunk is demoted to disk
        loop.step()
        loop.events.clear()
        req = Req("a2", a)
        assert loop.sched.get_num_new_matched_tokens(req, 0) == (8, True)
        loop.sched.update_state_after_alloc(req, loop.blocks(3), 8)
        loop.step()
        loop.step()
        a_chunk = block_hashes(a, BS)[1]
        moved = [(type(e).__name__, e.medium, e.locality) for e in loop.events]
        assert moved == [
            ("BlockStored", "CPU", None),
            ("BlockRemoved", "CPU", None),
            ("BlockStored", "STORAGE", "LOCAL"),
        ]
        assert loop.events[0].block_hashes[-1] == int.from_bytes(a_chunk[-8:], "big")
    finally:
        loop.shutdown()


def test_the_scheduler_knows_while_the_workers_still_owe_events(tmp_path: Path) -> None:
    """`has_pending_work` (vLLM's `has_pending_push_work`): true at start (the tiers announce
    what they hold), while saves are queued or running on any rank, false once every rank
    reported them and the quorum released their events."""
    loop = Loop([{"kind": "cpu", "max_bytes": 1 << 20}])
    sched = loop.sched.scheduler
    assert sched is not None
    try:
        assert sched.has_pending_work()
        loop.step()
        assert not sched.has_pending_work()
        out = SchedulerOutput()
        tokens = list(range(17))
        hashes = block_hashes(tokens, BS)
        ids = loop.blocks(5)
        out.scheduled_new_reqs.append(NewRequestData("a", tokens, hashes, ids))
        out.scheduled.append(ScheduledRequest("a", tokens, 0, ids, sample=True))
        meta = sched.build_connector_meta(out)
        assert len(meta.saves) == 2 and sched.has_pending_work()  # sent, nothing heard yet
        outputs = []
        for w in loop.workers:
            _, output = run_worker_step(w, roundtrip(meta), set(), lambda _hooks: None)
            outputs.append(roundtrip(output))
        agg = loop.aggregator.aggregate(outputs)
        sched.update_connector_output(agg)
        reported = agg.kv_connector_worker_meta
        assert isinstance(reported, OffloadWorkerMetadata)
        if any(reported.pending_io.values()):  # the I/O threads had not finished yet
            assert sched.has_pending_work()
        for w in loop.workers:
            assert w.worker is not None and w.worker.drain()
        loop.step()  # the ranks report their stores and pending_io 0
        assert not sched.has_pending_work()
        assert (
            len([e for e in sched.take_events() + loop.events if isinstance(e, BlockStored)]) == 2
        )
    finally:
        loop.shutdown()


def test_worker_metadata_folds_events_and_pending_io_per_rank() -> None:
    e0, e1 = BlockRemoved([1], "CPU"), BlockRemoved([2], "CPU")
    folded = OffloadWorkerMetadata({0: [e0]}, {0: 2}).aggregate(
        OffloadWorkerMetadata({1: [e1]}, {1: 0})
    )
    assert isinstance(folded, OffloadWorkerMetadata)
    assert folded.events_by_rank == {0: [e0], 1: [e1]} and folded.pending_io == {0: 2, 1: 0}


def test_after_a_reset_nothing_is_planned_from_the_tiers_being_emptied(tmp_path: Path) -> None:
    """vLLM may schedule a request in the very step that carries the reset to the workers: a
    load planned from the local tiers would meet tiers emptied first (a load error, or under
    vLLM's default policy a failed request). The reset must stop such plans at once."""
    loop = Loop([{"kind": "cpu", "max_bytes": 1 << 20}])
    tokens = list(range(40, 61))
    try:
        loop.step([("a", tokens, loop.blocks(6))])
        loop.step()
        assert loop.sched.get_num_new_matched_tokens(Req("b", tokens), 4) == (12, False)
        half = loop.sched.scheduler
        assert half is not None and half.has_pending_work() is False
        assert loop.sched.reset_cache() is True
        assert half.has_pending_work() is True  # an idle engine still steps to tell them
        assert loop.sched.get_num_new_matched_tokens(Req("c", tokens), 4) == (0, False)
        loop.step()  # the reset reaches the workers: the tier's chunks are announced removed
        stored = [e for e in loop.events if isinstance(e, BlockStored)]
        removed = [e for e in loop.events if isinstance(e, BlockRemoved)]
        assert len(stored) == len(removed) == 2  # both chunks, announced gone
        assert held_by_events(loop.events) == {"CPU": Counter()} and loop.invalid == set()
        assert half.has_pending_work() is False
    finally:
        loop.shutdown()


def test_pd_handshake_between_two_tp2_connectors(tmp_path: Path) -> None:
    """P (TP 2) finishes a `do_remote_decode` request: its answer names its peer port and
    its 2 chunks, and the next step leases them on both ranks. D (TP 2), given the answer's
    params, pulls every rank's shard from the same rank of P into blocks that held other KV,
    and releases the lease on both; the peers speak CurveZMQ with the certificate both
    configs name. An instance with `pd: false` answers nothing."""
    cpu = [{"kind": "cpu", "max_bytes": 1 << 20}]
    zmq.auth.create_certificates(str(tmp_path), "peers")
    (tmp_path / "peers.key_secret").chmod(0o600)
    curve = {"curve_secret_key_file": str(tmp_path / "peers.key_secret")}
    p_port = free_port(2)
    p = Loop(cpu, peer={"port": p_port, **curve})
    d = Loop(cpu, peer={"port": free_port(2), "sources": [f"127.0.0.1:{p_port}"], **curve})
    quiet = Loop(cpu, world_size=1, peer={"port": free_port(2), "pd": False})
    tokens = list(range(40, 61))  # 21 tokens: chunks 0 and 1 (16 tokens), 5 tokens left
    try:
        src = p.blocks(6)
        p.step([("a", tokens, src)])
        asked = {"do_remote_decode": True, "remote_host": None, "remote_port": None}
        hold, params = p.sched.request_finished(Req("a", tokens, asked), src)
        # its 5th block is saved as a tail in the next step: its blocks wait for that
        assert hold and params is not None
        assert (params["remote_host"], params["remote_port"], params["tp_size"]) == (
            "127.0.0.1",
            p_port,
            2,
        )
        assert params["remote_num_tokens"] == 16 and len(params["remote_chunk_hashes"]) == 2
        p.step()
        assert p.finished_sending == {"a"}
        for w in p.workers:
            assert w.worker is not None and len(w.worker.leases) == 1

        for caches in d.caches:  # D's blocks hold other KV than P's
            for layer in caches.values():
                layer.zero_()
        dst = d.remote_hit(Req("b", tokens, params))
        d.step()
        assert d.finished_recving == {"b"} and d.invalid == set()
        for p_caches, d_caches in zip(p.caches, d.caches, strict=True):
            for name, layer in d_caches.items():
                assert torch.equal(layer[:, dst[:4]], p_caches[name][:, src[:4]])
        for w in [*p.workers, *d.workers]:
            assert w.worker is not None and w.worker.drain()
            assert len(w.worker.leases) == 0
            w.worker.leases.check_integrity()
            for tier in w.worker.tiers:
                tier.check_integrity()

        quiet.step([("q", tokens, quiet.blocks(6))])
        _, none = quiet.sched.request_finished(Req("q", tokens, asked), [])
        assert none is None
    finally:
        for loop in (p, d, quiet):
            loop.shutdown()


def test_a_source_rank_that_dies_before_the_pull_makes_its_blocks_recompute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """P's rank 1 stops serving after D's lookup counted P's chunks: D's rank 0 pulls its
    shard, rank 1's pull fails in its timeout, and the load reports the chunks' blocks as
    errors (vLLM and kvconnect's engine recompute them), logged once, not once a chunk.
    Nothing leaks on either side."""
    cpu = [{"kind": "cpu", "max_bytes": 1 << 20}]
    p_port = free_port(2)
    p = Loop(cpu, peer={"port": p_port})
    d = Loop(cpu, peer={"port": free_port(2), "timeout_s": 0.5, "sources": [f"127.0.0.1:{p_port}"]})
    tokens = list(range(40, 61))
    try:
        p.step([("a", tokens, p.blocks(6))])
        p.step()
        source = {"host": "127.0.0.1", "port": p.sched.config.peer.port}  # type: ignore[union-attr]
        dst = d.remote_hit(Req("b", tokens, {"remote_kv_source": source}))
        dying = p.workers[1].worker
        assert dying is not None and dying.peers is not None
        dying.peers.server.close()
        with caplog.at_level(logging.WARNING, "kvconnect.connector.offload.peers.side"):
            d.step()
        assert d.finished_recving == {"b"} and d.invalid == set(dst[:4])
        port = p.sched.config.peer.port + 1  # type: ignore[union-attr]
        failed = [r for r in caplog.records if f"127.0.0.1:{port}" in r.getMessage()]
        assert len(failed) == 1, [r.getMessage() for r in failed]
        for w in d.workers:
            assert w.worker is not None and w.worker.drain()
            for tier in w.worker.tiers:
                tier.check_integrity()
    finally:
        p.shutdown()
        d.shutdown()


@contextlib.contextmanager
def stalled_source(namespace: str, port: int) -> Iterator[tuple[int, threading.Event]]:
    """A source on `port` that says it holds every chunk asked for, then sends none: it takes
    a pull's requests and answers nothing until the test is done. Yields its port and an
    event set once a pull's first request has arrived."""
    asked = threading.Event()

    def answer(verb: bytes, arg: bytes) -> Reply:
        if verb == b"S":
            return answer_of(msgspec.msgpack.encode(len(msgspec.msgpack.decode(arg))))
        asked.set()
        return None

    with fake_peer(answer, hello=Hello(1, 0, namespace), port=port) as peer:
        yield peer.port, asked


def test_a_holder_busy_pulling_from_a_stalled_source_still_serves_its_own_chunks() -> None:
    """A's pull thread waits on a source that sends nothing (for up to A's 30 s timeout);
    meanwhile B pulls A's chunks, and gets them at once. A peer's read used to queue behind
    the holder's own pulls: two busy instances pulling from each other waited on each other
    until both timed out and recomputed (seen as 10 s stalls in bench/placement.py)."""
    cpu = [{"kind": "cpu", "max_bytes": 1 << 20}]
    a_port, stalled = free_port(1), free_port(1)
    a = Loop(
        cpu,
        world_size=1,
        peer={"port": a_port, "timeout_s": 30, "sources": [f"127.0.0.1:{stalled}"]},
    )
    b = Loop(
        cpu,
        world_size=1,
        peer={"port": free_port(1), "timeout_s": 2, "sources": [f"127.0.0.1:{a_port}"]},
    )
    held, other = list(range(40, 61)), list(range(100, 121))
    try:
        src = a.blocks(6)
        a.step([("a", held, src)])
        a.step()
        a_io = a.workers[0].worker
        assert a_io is not None
        with stalled_source(a_io.namespace, stalled) as (port, asked):
            stuck = Req("x", other, {"remote_kv_source": {"host": "127.0.0.1", "port": port}})
            stuck_blocks = a.remote_hit(stuck)
            pulling = threading.Thread(target=a.step)
            pulling.start()
            assert asked.wait(10)  # A's pull thread is in that pull now, and stays there

            source = {"host": "127.0.0.1", "port": a.sched.config.peer.port}  # type: ignore[union-attr]
            dst = b.remote_hit(Req("b", held, {"remote_kv_source": source}))
            b.step()
            assert b.finished_recving == {"b"} and b.invalid == set()
            for name, layer in b.caches[0].items():
                assert torch.equal(layer[:, dst[:4]], a.caches[0][name][:, src[:4]])
            assert pulling.is_alive()  # B was served while A's pull still waited
        pulling.join(30)  # the source closed: A's pull fails, and its blocks recompute
        assert not pulling.is_alive() and a.invalid == set(stuck_blocks[:4])
        for loop in (a, b):
            io = loop.workers[0].worker
            assert io is not None and io.drain()
            for tier in io.tiers:
                tier.check_integrity()
    finally:
        a.shutdown()
        b.shutdown()
