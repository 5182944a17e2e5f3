"""Worker half of the offload connector: copies chunks out of the paged cache, stores and loads
them in the tiers on a background I/O thread, and reports every store and eviction as an event.

Per step (worker thread):
  handle_preemptions  the step's compute stream waits for the copies that still read blocks
                  (a device cache; device.py has the rules)
  start_load_kv   queue the step's loads (the I/O thread serves loads before stores)
  wait_for_save   copy each chunk to save out of the paged cache (so the engine may reuse its
                  blocks) and queue it; a full queue drops the store (counted)
  get_finished    requests whose loads completed; get_block_ids_with_load_errors: what failed
  build_connector_worker_meta   the events since the last step, under this rank

I/O thread: a store goes to the first local tier (cpu or disk); what that tier evicts is demoted
to the next local tier, or dropped; every redis tier gets the chunk too (shared, write-through).
A load looks in the tiers in order; a hit below the first local tier is promoted into it.
The cache is read through `layout.PagedKV` (any layout, one gather and one scatter) and
copied with `device.DeviceOps` (synchronous for a host cache; a stream, events and pinned
buffers for CUDA): a load is reported finished only after its copy into the cache is done.
What a tier returns must be the chunk asked for: its entry's token ids, parent hash, block
hashes and block size equal the scheduler's, its data has this rank's chunk shape and dtype
(`tiers.base.mismatch`; a key names only the last block's hash, and a shared tier holds what
anyone wrote). An entry that is not, or fails its signature, is a miss like an absent one,
counted in `num_integrity_misses`; a local tier drops it and announces its BlockRemoved (as it
does a corrupt entry), a shared one is not ours to change: this rank forgets it wrote it, so
the next save of the chunk writes it again.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvconnect.connector.base import KVConnectorContext, KVConnectorStats
from kvconnect.connector.offload.common import (
    GROUP_IDX,
    SPEC_KIND,
    ChunkInfo,
    LoadSpec,
    OffloadConfig,
    OffloadMetadata,
    OffloadWorkerMetadata,
    chunk_key,
    key_namespace,
)
from kvconnect.connector.offload.device import DeviceOps, Stream, device_ops_for
from kvconnect.connector.offload.kinds import TierKind
from kvconnect.connector.offload.layout import PagedKV, from_kv_planes
from kvconnect.connector.offload.leases import Leases
from kvconnect.connector.offload.tiers import TierPlacement, create_tier
from kvconnect.connector.offload.tiers.base import (
    Evicted,
    IntegrityError,
    StoredChunk,
    Tier,
    TierError,
    TierTooSmall,
    TierUnavailable,
    mismatch,
    pack,
    read_mac_key,
)
from kvconnect.connector.offload.tiers.cpu import CpuTier
from kvconnect.connector.offload.tiers.peer import (
    REPLY_SLACK,
    PeerClient,
    PeerServer,
    RecvBuffers,
    shared_curve,
)
from kvconnect.events import BlockRemoved, BlockStored, KVCacheEvent

logger = logging.getLogger(__name__)


def stored_event(info: ChunkInfo, kind: TierKind) -> BlockStored:
    """A chunk in a tier, described in full (tokens, parent, extra keys), as the engine's own
    events describe its blocks, so a router can check and use it on its own."""
    return BlockStored(
        list(info.block_hashes),
        info.parent_block_hash,
        list(info.token_ids),
        info.block_size,
        None,
        kind.medium,
        None,
        extra_keys=list(info.extra_keys or [None] * len(info.block_hashes)),
        group_idx=GROUP_IDX,
        kv_cache_spec_kind=SPEC_KIND,
        locality=kind.locality,
    )


def removed_event(info: ChunkInfo, kind: TierKind) -> BlockRemoved:
    return BlockRemoved(
        list(info.block_hashes), kind.medium, group_idx=GROUP_IDX, locality=kind.locality
    )


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
        self.tiers: list[Tier] = []
        self._local: list[int] = []  # indices of the local tiers (cpu, disk), in order
        self.placement = TierPlacement(context.world_size, self.rank, namespace=self.namespace)
        self.paged: PagedKV | None = None
        self.device_ops = device_ops
        self._unfenced: list[Any] = []  # copies that read blocks, not yet waited for by compute
        self._lock = threading.Lock()  # guards the fields the I/O thread shares with the step
        # Held for every call into a local tier but `contains`: by the I/O thread, and by a
        # peer's read on its server's thread (never queued behind the I/O thread's jobs: two
        # instances pulling from each other waited on each other until both timed out).
        # Never taken while holding `_lock`.
        self._tiers_lock = threading.RLock()
        self._events: list[KVCacheEvent] = []
        self._finished_loads: set[str] = set()
        self._finished_saves: set[str] = set()  # step thread only
        self._load_errors: set[int] = set()
        self._stats: dict[str, int] = {}
        self._cond = threading.Condition(self._lock)
        self._loads: deque[LoadJob] = deque()
        self._stores: deque[StoreJob] = deque()
        self._storing: Counter[str] = Counter()  # keys of the store jobs queued or running
        self.leases = Leases()
        self.peer_server: PeerServer | None = None
        self._peer_clients: dict[tuple[str, int], PeerClient] = {}
        self._recv_buffers: RecvBuffers | None = None
        peer = config.peer
        self._peer_mac = read_mac_key(peer.hmac_key_file) if peer and peer.hmac_key_file else None
        self._peer_curve = shared_curve(peer.curve_secret_key_file) if peer else None
        self._written_shared: set[str] = set()  # keys this rank put in shared tiers
        self._resets = 0
        self._busy = False
        self._reported_pending = 0
        self.metadata_class = metadata_class
        self._stop = False
        self._thread: threading.Thread | None = None

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
        self.tiers = []
        for t in self.config.tiers:
            try:
                self.tiers.append(create_tier(t, placement))
            except TierTooSmall as e:  # the chunk size is known only here, with the cache
                logger.warning("offload: %s; running without that tier", e)
        self._local = [i for i, t in enumerate(self.tiers) if not t.shared]
        for i, tier in enumerate(self.tiers):
            if isinstance(tier, CpuTier):
                tier.leased = self.leases.__contains__
                # What it evicts is demoted to a local tier below it, or dropped: then its
                # data is not copied out (a fresh 12 MB per eviction, and its page faults).
                tier.keep_evicted = any(j > i for j in self._local)
        for tier in self.tiers:
            for _, info in tier.entries():  # found again after a restart
                self._events.append(stored_event(info, tier.kind))
        self._thread = threading.Thread(target=self._io_loop, name="kv-offload-io", daemon=True)
        self._thread.start()
        peer = self.config.peer
        if peer is not None:
            # made now: populating them costs the first pull nothing
            numel = math.prod(self.placement.chunk_shape)
            self._recv_buffers = RecvBuffers(numel * self.placement.dtype.itemsize)
            self.peer_server = PeerServer(
                f"tcp://{peer.host}:{peer.port + self.rank}",
                self.context.world_size,
                self.rank,
                self.namespace,
                held=self._held_prefix,
                read=self._serve_read,
                release=self._release_lease,
                curve=self._peer_curve[0] if self._peer_curve else None,
                settling=self._settling,
                settle_s=peer.timeout_s / 2,
            )

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
        """Queue the step's loads for the I/O thread (first in its queue); return once the
        sync ones are done (their blocks are computed in this step's forward)."""
        ready = self._ops().record(Stream.COMPUTE) if meta.loads else None
        self._lease(meta)
        sync = {spec.request_id: spec for spec in meta.loads if spec.sync}
        with self._cond:
            if meta.reset:
                self._resets += 1
            self._loads.extend(LoadJob(spec, ready) for spec in meta.loads)
            self._cond.notify()
            if sync:  # the I/O thread notifies as each load finishes (or fails: then counted)
                self._cond.wait_for(lambda: sync.keys() <= self._finished_loads or self._stop)
                for rid, spec in sync.items():  # stopped first: the blocks are not loaded
                    if rid not in self._finished_loads:
                        self._load_errors.update(b for ids in spec.block_ids for b in ids)
                self._finished_loads -= sync.keys()  # done in this step: not reported as async

    def _ops(self) -> DeviceOps:
        if self.device_ops is None:
            self.device_ops = device_ops_for(torch.device("cpu"))
        return self.device_ops

    def wait_for_save(self, meta: OffloadMetadata) -> None:
        if meta.shared_gone:  # Redis dropped them: the next save of each writes it again
            world = self.context.world_size
            with self._lock:
                for last in meta.shared_gone:
                    self._written_shared.discard(chunk_key(self.namespace, world, self.rank, last))
        ready = None
        for save in meta.saves:
            key = self._key(save.chunk)
            if any(self.tiers[i].contains(key) for i in self._local) or (
                self._only_shared() and key in self._written_shared
            ):
                continue
            with self._lock:
                if len(self._stores) >= self.config.max_pending_stores:
                    self._count("num_stores_dropped")
                    continue
            if ready is None:  # once per step: the forward that wrote these blocks
                ready = self._ops().record(Stream.COMPUTE)
            job = self._copy_out(key, save.chunk, save.block_ids, ready)
            with self._cond:
                self._stores.append(job)
                self._storing[key] += 1
                self._cond.notify()
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

    def _only_shared(self) -> bool:
        return all(t.shared for t in self.tiers)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose last saves are copied out, requests whose loads are done)."""
        saved, self._finished_saves = self._finished_saves, set()
        with self._lock:
            done, self._finished_loads = self._finished_loads, set()
        return saved or None, done or None

    def wait_for_finished_load(self, timeout: float) -> bool:
        """Wait until some load has finished (and is not yet reported), up to `timeout`
        seconds, holding no lock and not the GIL; whether one has."""
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._finished_loads), timeout)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> OffloadWorkerMetadata | None:
        """The events since the last call, and how many I/O jobs are left (sent whenever it
        is not zero or has just become zero)."""
        with self._lock:
            events, self._events = self._events, []
            pending = len(self._loads) + len(self._stores) + self._busy + self._resets
        if not events and pending == self._reported_pending == 0:
            return None
        self._reported_pending = pending
        return self.metadata_class({self.rank: events}, {self.rank: pending})

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        with self._lock:
            stats, self._stats = self._stats, {}
        return KVConnectorStats(stats) if stats else None

    def _count(self, name: str, n: int = 1) -> None:
        self._stats[name] = self._stats.get(name, 0) + n

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until the I/O thread is idle (tests and shutdown)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not (self._loads or self._stores or self._busy or self._resets),
                timeout,
            )

    def shutdown(self) -> None:
        if self.peer_server is not None:  # first: no peer's read is queued after this
            self.peer_server.close()
        self.drain(timeout=5.0)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        for client in self._peer_clients.values():  # the I/O thread's, now that it is done
            client.close()
        with self._tiers_lock:  # a peer's read still in flight finishes first
            for tier in self.tiers:
                tier.close()

    # -- I/O thread ---------------------------------------------------------------------------

    def _io_loop(self) -> None:
        while (job := self._next_job()) is not None:
            try:
                self._run(job)
            except Exception:  # the thread must survive anything a tier does
                logger.exception("offload I/O job failed")
                with self._lock:
                    self._count("num_errors")
                    if isinstance(job, LoadJob):
                        self._finished_loads.add(job.spec.request_id)
                        self._load_errors.update(b for ids in job.spec.block_ids for b in ids)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _next_job(self) -> IoJob | None:
        """Wait for the next job and mark the thread busy with it; None once stopped."""
        with self._cond:
            self._cond.wait_for(lambda: self._stop or self._loads or self._stores or self._resets)
            if self._stop:
                return None
            self._busy = True
            if self._resets:  # resets carry nothing, so they are counted rather than queued
                self._resets -= 1
                return ResetJob()
            return self._loads.popleft() if self._loads else self._stores.popleft()

    def _run(self, job: IoJob) -> None:
        if isinstance(job, ResetJob):
            self._reset()
        elif isinstance(job, LoadJob):
            self._load(job)
        else:
            try:
                ops = self._ops()
                ops.synchronize(job.copied)
                self._store(job.key, job.chunk, ops.release(job.data))
            finally:
                with self._lock:
                    self._storing[job.key] -= 1
                    if self._storing[job.key] <= 0:
                        del self._storing[job.key]

    def _emit(self, *events: KVCacheEvent) -> None:
        with self._lock:
            self._events.extend(events)

    def _store(self, key: str, info: ChunkInfo, data: torch.Tensor) -> None:
        local = self._local
        if local:
            self._put(local[0], key, info, data)
        # A tail (fewer blocks than a chunk) stays local: only this instance looks for one.
        whole = len(info.block_hashes) == self.config.blocks_per_chunk
        for i, tier in enumerate(self.tiers):
            if tier.shared and whole:
                self._put(i, key, info, data)
        with self._lock:
            self._count("num_chunks_stored")

    def _put(self, index: int, key: str, info: ChunkInfo, data: torch.Tensor) -> None:
        """Put into tier `index`, demoting what it evicts to the next local tier."""
        tier = self.tiers[index]
        # A shared tier is written through: asking it first cost a round trip (and, with the
        # server hung, a timeout) whose answer was not used.
        try:
            with self._guard(tier):
                if not tier.shared and tier.contains(key):
                    return
                evicted = tier.put(key, info, data)
        except TierError as e:
            self._tier_failed(tier, e)
            return
        self._emit(stored_event(info, tier.kind))
        with self._lock:
            self._count(f"{tier.kind}_bytes_stored", data.numel() * data.element_size())
            if tier.shared:
                self._written_shared.add(key)
        self._evicted(index, evicted)

    def _evicted(self, index: int, evicted: list[Evicted]) -> None:
        tier = self.tiers[index]
        below = next(
            (j for j in range(index + 1, len(self.tiers)) if not self.tiers[j].shared), None
        )
        for ev in evicted:
            self._emit(removed_event(ev.info, tier.kind))
            with self._lock:
                self._count(f"num_{tier.kind}_evictions")
            if below is not None and ev.data is not None:
                self._put(below, ev.key, ev.info, ev.data)

    def _load(self, job: LoadJob) -> None:
        spec, ops, paged = job.spec, self._ops(), self.paged
        assert paged is not None, "register_kv_caches first"
        bs = self.context.block_size
        failed: set[int] = set()
        pulled = None
        if spec.source is not None:
            pulled = self._pulled(spec.source, spec.chunks[spec.from_source :])
        with ops.on_copy_stream():
            ops.wait(Stream.COPY, job.ready)  # the blocks' last reader is done with them
            for k, (info, block_ids, first) in enumerate(
                zip(spec.chunks, spec.block_ids, spec.first_block, strict=True)
            ):
                if pulled is not None and k >= spec.from_source:
                    data = next(pulled)
                else:
                    data = self._fetch(self._key(info), info)
                if data is None:
                    failed.update(block_ids[first:])
                    continue
                # a last chunk may be partial: only its blocks that the request holds
                part = ops.to_device(data[:, :, first * bs : len(block_ids) * bs], paged.device)
                paged.scatter(block_ids[first:], part)
            copied = ops.record(Stream.COPY)
        ops.synchronize(copied)  # finished only once the blocks hold the KV
        with self._lock:
            self._count("num_chunks_loaded", len(spec.chunks))
            if failed:
                self._count("num_load_errors")
                self._load_errors |= failed
            self._finished_loads.add(spec.request_id)
        if spec.source is not None and spec.lease is not None:
            try:  # after the load is reported: the request does not wait for this
                self._peer_client(spec.source).release(spec.lease)
            except TierError as e:  # the lease then expires at the source
                logger.info("offload: peer %s:%d: release of %r: %s", *spec.source, spec.lease, e)

    def _fetch(self, key: str, info: ChunkInfo) -> torch.Tensor | None:
        local = self._local
        for i, tier in enumerate(self.tiers):
            found = self._checked(tier, key, info)
            if found is None:
                continue
            data = found.data
            with self._lock:
                self._count(f"{tier.kind}_hits")
                self._count(f"{tier.kind}_bytes_loaded", data.numel() * data.element_size())
            if local and i != local[0]:  # a hit further down moves up
                self._put(local[0], key, info, data.clone())
            return data
        logger.warning("offload: chunk %s found in no tier", key)
        return None

    # -- peers ------------------------------------------------------------------------------

    def _pulled(
        self, source: tuple[str, int], chunks: list[ChunkInfo]
    ) -> Iterator[torch.Tensor | None]:
        """`chunks` from this rank's counterpart at `source` (rank r serves on port + r), in
        order, a few requests ahead (`PeerClient.fetch_many`), each checked as a shared tier's
        entry is (its key, checksum or signature, then `mismatch`) and kept in the first local
        tier, which announces it. None for one that failed: it is recomputed (counted,
        logged). A whole chunk is received straight into a cpu tier's slot, which holds it
        once it has passed the checks (no copy); others land in the receive buffers."""
        client = self._peer_client(source)
        wanted = [(self._key(info), info) for info in chunks]
        local = self._local
        sink = _IntoCpuTier(self, local[0]) if local else None
        # each chunk is kept and scattered before two more are read into the buffers
        pulls = client.fetch_many(wanted, self.placement, sink or self._recv_buffers)
        logged: TierError | None = None  # a source that stops answering: one line, not one a chunk
        try:
            for (key, info), got in zip(wanted, pulls, strict=True):
                slot = sink.reserved.pop(key, None) if sink is not None else None
                if isinstance(got, StoredChunk):
                    data = got.data
                    with self._lock:
                        self._count("peer_hits")
                        self._count("peer_bytes_loaded", data.numel() * data.element_size())
                    if sink is not None and slot is not None:
                        sink.commit(slot, key, info, data)
                    elif local:
                        self._put(local[0], key, info, data)
                    yield data
                    continue
                if sink is not None and slot is not None:
                    sink.unreserve(slot)
                if isinstance(got, IntegrityError):
                    logger.warning("offload: peer %s:%d: integrity miss: %s", *source, got)
                    with self._lock:
                        self._count("num_integrity_misses")
                        self._count("num_peer_integrity_misses")
                elif isinstance(got, TierError):
                    if got is not logged:
                        logger.warning("offload: peer %s:%d: %s", *source, got)
                        logged = got
                    with self._lock:
                        self._count("num_peer_errors")
                else:
                    with self._lock:
                        self._count("num_peer_misses")
                yield None
        finally:
            pulls.close()
            if sink is not None:  # a pull abandoned half-way: its slots go back
                for slot in sink.reserved.values():
                    sink.unreserve(slot)

    def _peer_client(self, source: tuple[str, int]) -> PeerClient:
        client = self._peer_clients.get(source)
        if client is None:
            peer = self.config.peer
            assert peer is not None, "a pull planned without a peer config"
            if len(self._peer_clients) >= 16:  # the oldest goes
                self._peer_clients.pop(next(iter(self._peer_clients))).close()
            numel = math.prod(self.placement.chunk_shape)
            client = self._peer_clients[source] = PeerClient(
                f"tcp://{source[0]}:{source[1] + self.rank}",
                self.context.world_size,
                self.rank,
                self.namespace,
                mac_key=self._peer_mac,
                timeout_s=peer.timeout_s,
                max_reply_bytes=numel * self.placement.dtype.itemsize + REPLY_SLACK,
                curve=self._peer_curve[1] if self._peer_curve else None,
            )
        return client

    def _lease(self, meta: OffloadMetadata) -> None:
        """Grant the step's leases (P/D) on this rank's keys of their chunks; end the ones
        whose time is up."""
        if not meta.leases and not len(self.leases):  # the usual step: nothing to do
            return
        world, released = self.context.world_size, 0
        for lease in meta.leases:
            ttl = lease.expires_at - time.time()
            keys = [chunk_key(self.namespace, world, self.rank, h) for h in lease.last_block_hashes]
            if ttl > 0 and not self.leases.grant(lease.lease_id, keys, ttl):
                released += 1  # its decode instance was faster than this step
        expired = self.leases.expire()
        with self._lock:
            if meta.leases:
                self._count("num_leases_granted", len(meta.leases))
            if released:
                self._count("num_leases_released", released)
            if expired:
                self._count("num_leases_expired", expired)

    def _release_lease(self, lease_id: str) -> bool:
        """For a peer (its server's thread): a decode instance has pulled what it leased."""
        released = self.leases.release(lease_id)
        if released:
            with self._lock:
                self._count("num_leases_released")
        return released

    def _held_prefix(self, keys: list[str]) -> int:
        """For a peer (its server's thread): how many of `keys`, from the first, a local tier
        holds (`contains` may be called from any thread). The server asks once none of them
        is `_settling`, or half the peer timeout later."""
        local = [self.tiers[i] for i in self._local]
        num = 0
        while num < len(keys) and any(t.contains(keys[num]) for t in local):
            num += 1
        return num

    def _settling(self, keys: list[str]) -> bool:
        """For a peer (its server's thread): whether a chunk of `keys` is on its way to a
        tier (its store queued: the request that computed it may have answered already, as a
        P/D prefill does at once)."""
        with self._lock:
            return any(k in self._storing for k in keys)

    def _serve_read(self, key: str) -> list[Any] | None:
        """For a peer (its server's threads): chunk `key` serialised, `pack`'s parts, or None
        if no local tier holds it. The payload is a view of the tier's own memory (sent
        without a copy), its checksum taken under the tiers' lock, so no store writes the
        slot meanwhile. Should a later store reuse a cpu slot while its bytes are still being
        sent, the peer receives bytes that do not match that checksum (or signature) and
        refuses the chunk: a recompute, never wrong KV."""
        with self._tiers_lock:
            for i in self._local:
                try:
                    found = self.tiers[i].load(key)
                except TierError:
                    continue
                if found is not None:
                    with self._lock:
                        self._count("peer_chunks_served")
                    return list(pack(key, found.info, found.data, self._peer_mac))
        return None

    def _checked(self, tier: Tier, key: str, info: ChunkInfo) -> StoredChunk | None:
        """`tier`'s entry for `key` if it is the chunk `info` describes; None otherwise (absent,
        unreadable, or another chunk: then dropped from a local tier and announced)."""
        try:
            with self._guard(tier):
                found = tier.load(key)
        except IntegrityError as e:
            self._integrity_miss(tier, key, info, str(e), dropped=True)
            return None
        except TierError as e:
            self._tier_failed(tier, e)
            if not tier.shared:  # the bad entry is gone from the tier
                self._emit(removed_event(info, tier.kind))
            return None
        if found is None:
            return None
        why = mismatch(info, found, self.placement)
        if why is None:
            return found
        self._integrity_miss(tier, key, info, f"chunk {key}: {why}", dropped=False)
        return None

    def _tier_failed(self, tier: Tier, e: TierError) -> None:
        """Count a failed put or load in `num_<kind>_errors`, and a fast failure (the tier
        backing off, nothing tried) also in `num_<kind>_fast_failures`: logged only at debug
        level, as the tier logged the failure that started the back-off."""
        fast = isinstance(e, TierUnavailable)
        logger.log(logging.DEBUG if fast else logging.WARNING, "offload: %s", e)
        with self._lock:
            self._count(f"num_{tier.kind}_errors")
            if fast:
                self._count(f"num_{tier.kind}_fast_failures")

    def _integrity_miss(
        self, tier: Tier, key: str, info: ChunkInfo, why: str, dropped: bool
    ) -> None:
        """An entry that is not the chunk asked for: a miss, counted and logged; a local tier
        loses it (announced: BlockRemoved of what it had announced), a shared tier is only
        written again by this rank's next save of the chunk."""
        logger.warning("offload: %s tier: integrity miss: %s", tier.kind, why)
        with self._lock:
            self._count("num_integrity_misses")
            self._count(f"num_{tier.kind}_integrity_misses")
            if tier.shared:
                self._written_shared.discard(key)
        if not tier.shared:
            with self._tiers_lock:
                held = info if dropped else tier.remove(key)
            if held is not None:
                self._emit(removed_event(held, tier.kind))

    def _reset(self) -> None:
        """Empty the local tiers, announcing exactly what each dropped (a shared tier is not
        ours to empty), so a router keeps what the engine itself still holds."""
        for tier in self.tiers:
            with self._guard(tier):
                dropped = tier.clear()
            self._emit(*(removed_event(info, tier.kind) for _, info in dropped))

    def _guard(self, tier: Tier) -> contextlib.AbstractContextManager[Any]:
        """What a call into `tier` holds: the tiers' lock for a local one; nothing for a
        shared one (only the I/O thread calls it, and a round trip must not hold up a peer)."""
        return contextlib.nullcontext() if tier.shared else self._tiers_lock


class _IntoCpuTier:
    """A pull's `PayloadSink`: a whole chunk's payload is read into a slot of the worker's
    first local tier when that is a cpu tier (reserved, evicting as a put would); anything
    else into the worker's receive buffers. The worker commits or unreserves each slot."""

    def __init__(self, worker: OffloadWorker, index: int) -> None:
        self.worker, self.index = worker, index
        tier = worker.tiers[index]
        self.tier = tier if isinstance(tier, CpuTier) else None
        self.reserved: dict[str, int] = {}

    def take(self, key: str, n: int) -> memoryview | None:
        tier = self.tier
        got = None
        if tier is not None and n == tier.slot_bytes:
            with self.worker._tiers_lock:
                got = tier.reserve(key)
        if got is None:
            buffers = self.worker._recv_buffers
            return buffers.take(key, n) if buffers is not None else None
        slot, view, evicted = got
        self.reserved[key] = slot
        self.worker._evicted(self.index, evicted)
        return view

    def unreserve(self, slot: int) -> None:
        assert self.tier is not None
        with self.worker._tiers_lock:
            self.tier.unreserve(slot)

    def commit(self, slot: int, key: str, info: ChunkInfo, data: torch.Tensor) -> None:
        """The checked chunk in `slot` is now the tier's: announced and counted as a put."""
        assert self.tier is not None
        worker = self.worker
        try:
            with worker._tiers_lock:
                self.tier.commit(slot, key, info)
        except TierError as e:
            worker._tier_failed(self.tier, e)
            return
        worker._emit(stored_event(info, self.tier.kind))
        with worker._lock:
            worker._count(f"{self.tier.kind}_bytes_stored", data.numel() * data.element_size())
