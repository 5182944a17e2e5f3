"""Worker half of the offload connector: copies chunks out of the paged cache, stores and loads
them in the tiers off the step thread, and reports every store and eviction as an event.

Per step (the step thread):
  handle_preemptions  the step's compute stream waits for the copies that still read blocks
                  (a device cache; device.py has the rules)
  start_load_kv   loads wholly from the cpu tier run now (host memory copies: a few ms,
                  before the forward that computes the prompts' rest); the others are queued
  wait_for_save   copy each chunk to save out of the paged cache (so the engine may reuse its
                  blocks) and queue it; a full queue drops the store (counted)
  get_finished    requests whose loads completed; get_block_ids_with_load_errors: what failed
  build_connector_worker_meta   the events since the last step, under this rank

Threads. The step thread never waits on another thread's I/O: a load it runs touches the cpu
tier only, under that tier's lock.
- The I/O thread: stores, loads from this instance's tiers, resets. A store goes to the first
  local tier (cpu or disk); what that tier evicts is demoted to the next local tier, or
  dropped; every redis tier gets the chunk too (shared, write-through). A load looks in the
  tiers in order; a hit below the first local tier is promoted into it.
- PULL_THREADS pull threads: loads that pull from a peer (peers/side.py), each bounded by its
  deadline, so a slow or hostile source holds one of them, never the stores or other loads.
- The peer server's threads serve this rank's chunks to other instances (`_serve_read`).
The tiers and their locks are `rank_tiers.RankTiers` (each local tier's lock held for every
call into it and for as long as anyone copies out of its memory); what they find and do is
reported in a `rank_tiers.Report` (events, counters). `_cond` guards the lanes' queues and the
finished loads; no tier lock is taken while holding it.

The cache is read through `layout.PagedKV` (any layout, one gather and one scatter) and
copied with `device.DeviceOps` (synchronous for a host cache; a stream, events and pinned
buffers for CUDA): a load is reported finished only after its copy into the cache is done.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from kvconnect.connector.base import KVConnectorContext, KVConnectorStats
from kvconnect.connector.offload.common import (
    ChunkInfo,
    LoadSpec,
    OffloadConfig,
    OffloadMetadata,
    OffloadWorkerMetadata,
    chunk_key,
    key_namespace,
)
from kvconnect.connector.offload.device import DeviceOps, Stream, device_ops_for
from kvconnect.connector.offload.layout import PagedKV, from_kv_planes
from kvconnect.connector.offload.peers.leases import Grant, Leases
from kvconnect.connector.offload.peers.protocol import Served
from kvconnect.connector.offload.peers.side import PeerSide
from kvconnect.connector.offload.peers.transport import PeerKeys
from kvconnect.connector.offload.rank_tiers import RankTiers, Report
from kvconnect.connector.offload.tiers import TierPlacement
from kvconnect.connector.offload.tiers.base import Tier
from kvconnect.connector.offload.tiers.cpu import CpuTier

logger = logging.getLogger(__name__)

PULL_THREADS = 2
"""Loads that pull from peers at once (each its own source's connection and buffers)."""


@dataclass(frozen=True)
class StoreJob:
    """One chunk to store, copied out of the paged cache: `data` is complete once `copied`
    has happened (at once for a host cache)."""

    key: str
    chunk: ChunkInfo
    data: torch.Tensor
    copied: Any = None


@dataclass(frozen=True)
class LoadJob:
    """A request's loads; its blocks' last reader on the compute stream is `ready`."""

    spec: LoadSpec
    ready: Any = None


@dataclass(frozen=True)
class ResetJob:
    """Empty the local tiers (the engine's cache was reset)."""


IoJob = ResetJob | LoadJob | StoreJob
"""What the I/O thread runs, in this order of priority: resets, loads, stores."""


class OffloadWorker:
    def __init__(
        self,
        context: KVConnectorContext,
        config: OffloadConfig,
        metadata_class: type[OffloadWorkerMetadata] = OffloadWorkerMetadata,
        device_ops: DeviceOps | None = None,
    ) -> None:
        """`metadata_class` is what `build_connector_worker_meta` builds: an engine that needs
        its own type for the workers' metadata (vLLM) gives a subclass. `device_ops`: how
        blocks are copied (default: by the cache's device, `device.device_ops_for`)."""
        self.context = context
        self.config = config
        self.rank = context.rank
        self.namespace = key_namespace(
            context.model_name, context.model_fingerprint, context.block_size, config.chunk_size
        )
        self.report = Report()
        self.local_tiers: RankTiers | None = None  # made with the cache (`register_paged_kv`)
        self.placement = TierPlacement(context.world_size, self.rank, namespace=self.namespace)
        self.paged: PagedKV | None = None
        self.device_ops = device_ops
        self._unfenced: list[Any] = []  # copies that read blocks, not yet waited for by compute
        self._cond = threading.Condition()  # guards the lanes' queues and the finished loads
        self._finished_loads: set[str] = set()
        self._finished_saves: set[str] = set()  # step thread only
        self._load_errors: set[int] = set()
        self._loads: deque[LoadJob] = deque()
        self._stores: deque[StoreJob] = deque()
        self._pulls: deque[LoadJob] = deque()
        self._storing: Counter[str] = Counter()  # keys of the store jobs queued or running
        peer = config.peer
        self.leases = Leases(
            max_share=peer.max_leased_share if peer else 1.0,
            max_share_per_client=peer.max_leased_share_per_client if peer else 1.0,
        )
        self.peers: PeerSide | None = None
        self.peer_keys = PeerKeys.from_config(config)  # a wrong key file fails the start
        self._resets = 0
        self._busy_since: dict[str, float] = {}  # a lane thread running a job -> its start
        self._reported_pending = 0
        self.metadata_class = metadata_class
        self._stop = False
        self._threads: list[threading.Thread] = []

    @property
    def tiers(self) -> list[Tier]:
        return self.local_tiers.tiers if self.local_tiers is not None else []

    def _local(self) -> RankTiers:
        assert self.local_tiers is not None, "register_kv_caches first"
        return self.local_tiers

    # -- setup ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """kvconnect's engine: each layer [2 (K, V), num_blocks, block_size, kv_heads, dim]."""
        views = {name: from_kv_planes(name, kv) for name, kv in kv_caches.items()}
        self.register_paged_kv(PagedKV.from_views(views))

    def register_paged_kv(self, paged: PagedKV) -> None:
        """The cache through its layout (an engine with another layout builds the views)."""
        if paged.block_size != self.context.block_size:
            raise ValueError(
                f"kvconnect OffloadConnector: the cache has {paged.block_size}-token blocks, "
                f"the engine's block size is {self.context.block_size}"
            )
        self.paged = paged
        if self.device_ops is None:
            self.device_ops = device_ops_for(paged.device)
        self.placement = placement = TierPlacement(
            self.context.world_size,
            self.rank,
            paged.chunk_shape(self.config.chunk_size),
            paged.dtype,
            self.namespace,
        )
        self.local_tiers = tiers = RankTiers(self.config.tiers, placement, self.report)
        for tier in tiers.tiers:
            if isinstance(tier, CpuTier):
                tier.leased = self.leases.__contains__
                if self.leases.capacity is None:  # the first cpu tier's slots bound the leases
                    self.leases.capacity = tier.num_slots
        lanes = [("kv-offload-io", partial(self._lane, self._pick_io, self._run))]
        peer = self.config.peer
        if peer is not None:
            mac = self.peer_keys.mac
            served = Served(
                tiers.held_prefix,
                lambda key: tiers.read(key, mac),
                self._release_lease,
                self._settling,
                peer.timeout_s / 2,
            )
            self.peers = PeerSide(peer, self.peer_keys, placement, self.namespace, served)
            pull = partial(self._lane, self._pick_pull, self._run)
            lanes += [(f"kv-offload-pull-{i}", pull) for i in range(PULL_THREADS)]
        for name, loop in lanes:
            thread = threading.Thread(target=loop, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def _key(self, info: ChunkInfo) -> str:
        return chunk_key(self.namespace, self.context.world_size, self.rank, info.last_block_hash)

    # -- step ---------------------------------------------------------------------------------

    def handle_preemptions(self) -> None:
        """Before the step writes anything into the cache: the compute stream waits for the
        copies that still read blocks (saves queued by the last steps), so a block freed and
        given to another request is overwritten only after its chunk was copied out."""
        ops = self._ops()
        for event in self._unfenced:
            ops.wait(Stream.COMPUTE, event)
        self._unfenced.clear()

    def start_load_kv(self, meta: OffloadMetadata) -> None:
        """Run the step's loads wholly from the cpu tier now (their blocks are computed in this
        step's forward); queue the others: from peers for the pull threads, the rest for the
        I/O thread (first in its queue)."""
        ready = self._ops().record(Stream.COMPUTE) if meta.loads else None
        self._lease(meta)
        with self._cond:
            if meta.reset:
                self._resets += 1
            for spec in meta.loads:
                if not spec.sync:
                    lane = self._loads if spec.source is None else self._pulls
                    lane.append(LoadJob(spec, ready))
            self._cond.notify_all()
        for spec in meta.loads:
            if spec.sync:
                self._load_now(LoadJob(spec, ready))

    def _ops(self) -> DeviceOps:
        if self.device_ops is None:
            self.device_ops = device_ops_for(torch.device("cpu"))
        return self.device_ops

    def wait_for_save(self, meta: OffloadMetadata) -> None:
        tiers = self._local()
        if meta.shared_gone:  # Redis dropped them: the next save of each writes it again
            world = self.context.world_size
            keys = [chunk_key(self.namespace, world, self.rank, h) for h in meta.shared_gone]
            tiers.forget_shared(keys)
        ready = None
        for save in meta.saves:
            key = self._key(save.chunk)
            if tiers.contains_locally(key) or (tiers.only_shared() and tiers.written(key)):
                continue
            with self._cond:
                full = len(self._stores) >= self.config.max_pending_stores
            if full:
                self.report.count("num_stores_dropped")
                continue
            if ready is None:  # once per step: the forward that wrote these blocks
                ready = self._ops().record(Stream.COMPUTE)
            job = self._copy_out(key, save.chunk, save.block_ids, ready)
            with self._cond:
                self._stores.append(job)
                self._storing[key] += 1
                self._cond.notify_all()
        # Copied out (or on the copy stream, which the next step's compute waits for: see
        # handle_preemptions): the blocks may go.
        self._finished_saves.update(meta.finished_saves)

    def _copy_out(self, key: str, info: ChunkInfo, block_ids: list[int], ready: Any) -> StoreJob:
        """Queue the copy of the blocks to host memory on the copy stream, after `ready`."""
        ops, paged = self._ops(), self.paged
        assert paged is not None, "register_kv_caches first"
        with ops.on_copy_stream():
            ops.wait(Stream.COPY, ready)
            data = ops.to_host(paged.gather(block_ids))
            copied = ops.record(Stream.COPY)
        if copied is not None:  # a host cache's copy is done already (SyncOps: no event)
            self._unfenced.append(copied)
        return StoreJob(key, info, data, copied)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose last saves are copied out, requests whose loads are done)."""
        saved, self._finished_saves = self._finished_saves, set()
        with self._cond:
            done, self._finished_loads = self._finished_loads, set()
        return saved or None, done or None

    def wait_for_finished_load(self, timeout: float) -> bool:
        """Wait until some load has finished (and is not yet reported), up to `timeout`
        seconds, holding no lock and not the GIL; whether one has."""
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._finished_loads), timeout)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._cond:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> OffloadWorkerMetadata | None:
        """The events since the last call, how many I/O jobs are left (sent whenever it is
        not zero or has just become zero) and how long the longest has run."""
        with self._cond:  # first: a job that ends after this has emitted its events by then
            pending = self._num_pending()
            now = time.monotonic()
            busy = max((now - t for t in self._busy_since.values()), default=0.0)
        events = self.report.take_events()
        if not events and pending == self._reported_pending == 0:
            return None
        self._reported_pending = pending
        return self.metadata_class({self.rank: events}, {self.rank: pending}, {self.rank: busy})

    def _num_pending(self) -> int:
        """Jobs queued or running, on every lane (under `_cond`)."""
        queued = len(self._loads) + len(self._stores) + len(self._pulls) + self._resets
        return queued + len(self._busy_since)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        stats = self.report.take_stats()
        return KVConnectorStats(stats) if stats else None

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until every lane is idle (tests and shutdown)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._num_pending(), timeout)

    def shutdown(self) -> None:
        if self.peers is not None:  # first: no peer's read is queued after this
            self.peers.server.close()
        self.drain(timeout=5.0)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=5.0)
        if self.peers is not None:  # the pull threads' clients, now that they are done
            self.peers.close()
        if self.local_tiers is not None:  # a peer's read still in flight finishes first
            self.local_tiers.close()

    # -- the lanes ----------------------------------------------------------------------------

    def _lane(self, pick: Callable[[], IoJob | None], run: Callable[[IoJob], None]) -> None:
        """A lane's thread: run what `pick` takes from its queue (under `_cond`), one job at a
        time, until stopped; the job counts as pending (`_busy_since`) until it is done."""
        name = threading.current_thread().name
        while True:
            with self._cond:
                job = None
                while not self._stop and (job := pick()) is None:
                    self._cond.wait()
                if job is None:
                    return
                self._busy_since[name] = time.monotonic()
            try:
                run(job)
            except Exception:  # the thread must survive anything a tier or a peer does
                self._job_failed(job)
            finally:
                with self._cond:
                    del self._busy_since[name]
                    self._cond.notify_all()

    def _pick_io(self) -> IoJob | None:
        """The I/O thread's next job, in this order: resets, loads, stores."""
        if self._resets:  # resets carry nothing, so they are counted rather than queued
            self._resets -= 1
            return ResetJob()
        if self._loads:
            return self._loads.popleft()
        return self._stores.popleft() if self._stores else None

    def _pick_pull(self) -> IoJob | None:
        return self._pulls.popleft() if self._pulls else None

    def _job_failed(self, job: IoJob) -> None:
        logger.exception("offload I/O job failed")
        self.report.count("num_errors")
        if isinstance(job, LoadJob):
            with self._cond:
                self._finished_loads.add(job.spec.request_id)
                self._load_errors.update(b for ids in job.spec.block_ids for b in ids)

    def _run(self, job: IoJob) -> None:
        tiers = self._local()
        if isinstance(job, ResetJob):
            tiers.reset()
        elif isinstance(job, LoadJob):
            self._load(job)
        else:
            try:
                ops = self._ops()
                ops.synchronize(job.copied)
                whole = len(job.chunk.block_hashes) == self.config.blocks_per_chunk
                tiers.store(job.key, job.chunk, ops.release(job.data), whole)
                self.report.count("num_chunks_stored")
            finally:
                with self._cond:
                    self._storing[job.key] -= 1
                    if self._storing[job.key] <= 0:
                        del self._storing[job.key]

    # -- loads --------------------------------------------------------------------------------

    def _load_now(self, job: LoadJob) -> None:
        """A load wholly from the cpu tier, on the step thread, before the forward: the tier's
        lock is held while its slots are copied out, so no store overwrites them meanwhile.
        A chunk gone since the scheduler planned it is a load error (recomputed), as is every
        chunk once the worker is shut down (its tiers are closed)."""
        tiers = self._local()
        cpu = tiers.cpu_tier()
        failed: set[int] = set()
        if cpu is None or self._stop:
            failed = {b for ids in job.spec.block_ids for b in ids}
        else:
            with tiers.guard(cpu):
                failed = self._scatter_all(
                    job, lambda _, key, info, use: tiers.fetch_from(cpu, key, info, use)
                )
        self._loaded(job, failed, finished=False)

    def _load(self, job: LoadJob) -> None:
        """A queued load (the I/O thread's, or a pull thread's when it names a source): the
        chunks from this instance's tiers, then those pulled from the source; reported
        finished once the blocks hold the KV."""
        spec, tiers = job.spec, self._local()
        pulled = None
        if spec.source is not None:
            assert self.peers is not None, "a pull planned without a peer config"
            wanted = [(self._key(info), info) for info in spec.chunks[spec.from_source :]]
            pulled = self.peers.pull(spec.source, wanted, _PullInto(tiers, self.report))

        def chunk(k: int, key: str, info: ChunkInfo, use: Callable[[torch.Tensor], None]) -> bool:
            if pulled is not None and k >= spec.from_source:
                data = next(pulled)
                if data is None:
                    return False
                use(data)  # before the next chunk is read into the buffers or committed
                return True
            return tiers.fetch(key, info, use)

        try:
            failed = self._scatter_all(job, chunk)
            for _ in pulled or ():  # past the last chunk's use: it is kept (committed)
                pass
        finally:
            if pulled is not None:
                pulled.close()
        self._loaded(job, failed, finished=True)
        if spec.source is not None and spec.lease is not None and self.peers is not None:
            self.peers.release(spec.source, spec.lease)  # after the load is reported

    def _loaded(self, job: LoadJob, failed: set[int], finished: bool) -> None:
        """Count a load; its blocks that failed are recomputed; an async one is `finished`."""
        self.report.count("num_chunks_loaded", len(job.spec.chunks))
        if failed:
            self.report.count("num_load_errors")
        with self._cond:
            self._load_errors |= failed
            if finished:
                self._finished_loads.add(job.spec.request_id)
                self._cond.notify_all()

    def _scatter_all(
        self,
        job: LoadJob,
        chunk: Callable[[int, str, ChunkInfo, Callable[[torch.Tensor], None]], bool],
    ) -> set[int]:
        """Each of the job's chunks, got by `chunk(k, key, info, use)` (which calls `use` on its
        data while that is safe to read), scattered into its blocks; the blocks of those not
        got. Returns once the copies are done."""
        spec, ops, paged = job.spec, self._ops(), self.paged
        assert paged is not None, "register_kv_caches first"
        bs = self.context.block_size
        failed: set[int] = set()
        with ops.on_copy_stream():
            ops.wait(Stream.COPY, job.ready)  # the blocks' last reader is done with them
            for k, (info, block_ids, first) in enumerate(
                zip(spec.chunks, spec.block_ids, spec.first_block, strict=True)
            ):

                def scatter(data: torch.Tensor, ids: list[int] = block_ids, f: int = first) -> None:
                    # a last chunk may be partial: only its blocks that the request holds
                    part = ops.to_device(data[:, :, f * bs : len(ids) * bs], paged.device)
                    paged.scatter(ids[f:], part)

                if not chunk(k, self._key(info), info, scatter):
                    failed.update(block_ids[first:])
            copied = ops.record(Stream.COPY)
        ops.synchronize(copied)  # finished only once the blocks hold the KV
        return failed

    # -- leases (P/D) and what the peer server asks ---------------------------------------------

    def _lease(self, meta: OffloadMetadata) -> None:
        """Grant the step's leases (P/D) on this rank's keys of their chunks; end the ones
        whose time is up."""
        if not meta.leases and not len(self.leases):  # the usual step: nothing to do
            return
        world, done = self.context.world_size, Counter[Grant]()
        for lease in meta.leases:
            ttl = lease.expires_at - time.time()
            keys = [chunk_key(self.namespace, world, self.rank, h) for h in lease.last_block_hashes]
            if ttl > 0:
                done[self.leases.grant(lease.lease_id, keys, ttl, lease.owner)] += 1
        expired = self.leases.expire()
        if meta.leases:
            self.report.count("num_leases_granted", len(meta.leases) - done[Grant.REFUSED])
        if done[Grant.RELEASED]:  # its decode instance was faster than this step
            self.report.count("num_leases_released", done[Grant.RELEASED])
        if done[Grant.REFUSED]:
            self.report.count("num_leases_refused", done[Grant.REFUSED])
        if expired:
            self.report.count("num_leases_expired", expired)

    def _release_lease(self, lease_id: str) -> bool:
        """For a peer (its server's thread): a decode instance has pulled what it leased."""
        released = self.leases.release(lease_id)
        if released:
            self.report.count("num_leases_released")
        return released

    def _settling(self, keys: list[str]) -> bool:
        """For a peer (its server's thread): whether a chunk of `keys` is on its way to a
        tier (its store queued: the request that computed it may have answered already, as a
        P/D prefill does at once)."""
        with self._cond:
            return any(k in self._storing for k in keys)


class _PullInto:
    """Where one load's pulled chunks go (`peers.side.PullTarget`): a whole chunk is received
    straight into a reserved slot of the first local tier when that is a cpu tier, committed
    once checked and scattered; otherwise it is put there from the pull's buffers."""

    def __init__(self, tiers: RankTiers, report: Report) -> None:
        self.tiers, self.report = tiers, report
        self.slots: dict[str, int] = {}

    def take(self, key: str, n: int) -> memoryview | None:
        got = self.tiers.reserve(key, n)
        if got is None:
            return None
        self.slots[key] = got[0]
        return got[1]

    def keep(self, key: str, info: ChunkInfo, data: torch.Tensor) -> None:
        slot = self.slots.pop(key, None)
        if slot is not None:
            self.tiers.commit(slot, key, info, data)
        elif self.tiers.local:
            self.tiers.put(self.tiers.local[0], key, info, data)

    def drop(self, key: str) -> None:
        slot = self.slots.pop(key, None)
        if slot is not None:
            self.tiers.unreserve(slot)

    def count(self, name: str, n: int = 1) -> None:
        self.report.count(name, n)
