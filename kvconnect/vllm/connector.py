"""`OffloadConnector` for vLLM: kvconnect's offload connector (cpu, disk, redis tiers) as a
vLLM V1 KV connector, loaded by vLLM from `kv_connector_module_path`:

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadConnector",
        "kv_connector_module_path": "kvconnect.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"chunk_size": 256, "tiers": [...]}}'

The halves are kvconnect's own (`connector/offload/scheduler.py`, `worker.py`); `adapter.py`
translates vLLM's objects. What it adds for vLLM:

    events    the workers' tier events travel in this connector's KVConnectorWorkerMetadata
              (vLLM folds it across TP ranks with `aggregate`), are released by quorum in the
              scheduler and returned from `take_events`, so vLLM's publisher sends them with
              vLLM's own GPU events; inside vLLM's MultiConnector they still arrive, as each
              child's metadata is routed back to it. `get_kv_connector_kv_cache_events` is
              not used.
    loads     from the cpu tier alone, sync: done when vLLM binds the step's metadata,
              before the forward that computes the request's rest. Others async: a request
              waits in WAITING_FOR_REMOTE_KVS while the workers' I/O threads fill its
              blocks; a request that finishes (an abort) while its load runs keeps its
              blocks until the load is done (`request_finished` -> True). A step's loads
              start when vLLM binds the step's metadata, before the forward (vLLM calls
              `start_load_kv` for async loads only after it), so a load done during the
              forward is reported in that step's output and its request runs in the next.
              A step that computes nothing (the engine only waits for loads) waits up to
              IDLE_LOAD_WAIT_S for one to finish: vLLM's loop would otherwise spin against
              the I/O thread for the GIL, which each of its copies must take again.
    idle      `has_pending_push_work` keeps vLLM stepping while stores are still running,
              so their events are published without new traffic.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvconnect.connector.offload.common import OffloadConfig
from kvconnect.connector.offload.connector import OffloadHalves
from kvconnect.connector.offload.scheduler import OffloadScheduler
from kvconnect.connector.offload.worker import OffloadWorker
from kvconnect.vllm.adapter import (
    OffloadMetadataForVllm,
    OffloadPromMetrics,
    OffloadStats,
    OffloadWorkerMetadataForVllm,
    check_version,
    connector_context,
    connector_output,
    scheduler_output,
    to_vllm_event,
)
from kvconnect.vllm.layout import paged_kv

logger = logging.getLogger(__name__)


def _log_like_vllm() -> None:
    """kvconnect's log lines (tier warnings, the connector's start line) through vLLM's own
    handlers, so they appear in vLLM's log in its format."""
    ours, theirs = logging.getLogger("kvconnect"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(theirs.level)
        ours.propagate = False


_log_like_vllm()

IDLE_LOAD_WAIT_S = 0.02
"""How long a step with nothing to compute waits for a load under way (a new request that
arrives meanwhile waits as long at most)."""


class OffloadConnector(OffloadHalves, KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        check_version()
        context = connector_context(vllm_config, role)
        self.config = OffloadConfig.from_extra_config(
            context.kv_transfer_config.kv_connector_extra_config, context.block_size
        )
        self.scheduler: OffloadScheduler | None = None
        self.worker: OffloadWorker | None = None
        self._started: KVConnectorMetadata | None = None  # the step whose loads are queued
        self._inflight: set[str] = set()  # worker: requests whose loads are not reported yet
        self._requests: dict[str, Any] = {}  # vLLM Requests whose chunks are saved
        self._loading: set[str] = set()  # requests whose load the workers still run
        if role == KVConnectorRole.SCHEDULER:
            if vllm_config.kv_transfer_config.kv_load_failure_policy != "recompute":
                logger.warning(
                    "kvconnect OffloadConnector: kv_load_failure_policy is %r, so a chunk that "
                    "cannot be loaded (a tier down, an entry evicted) fails its request; "
                    'set "kv_load_failure_policy": "recompute" to recompute it instead',
                    vllm_config.kv_transfer_config.kv_load_failure_policy,
                )
            self.scheduler = OffloadScheduler(context, self.config, OffloadMetadataForVllm)
        else:
            self.worker = OffloadWorker(context, self.config, OffloadWorkerMetadataForVllm)
        logger.info(
            "kvconnect OffloadConnector (%s, rank %d of %d): chunk %d tokens, tiers %s",
            role.name.lower(),
            context.rank,
            context.world_size,
            self.config.chunk_size,
            ", ".join(t.kind for t in self.config.tiers),
        )

    # -- worker side ---------------------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None:  # queued now: the I/O thread loads during the forward
            meta = self._meta()
            self.worker.start_load_kv(meta)  # returns once the sync loads are done
            self._inflight.update(load.request_id for load in meta.loads if not load.sync)
            self._started = connector_metadata

    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        if self._started is not self._get_connector_metadata():
            super().start_load_kv(forward_context, **kwargs)
        self._started = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """The caches as vLLM describes them (layout, each group's spec: vllm/layout.py); a
        layer it cannot store fails the start with one line naming it."""
        config = self._kv_cache_config
        paged = paged_kv(kv_caches, config, self._vllm_config, self.config.block_size)
        self._work().register_paged_kv(paged)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """First in each step, before anything writes the cache: the copies still reading
        blocks come first (device.py). On a host cache copies are already done."""
        self._work().handle_preemptions()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._inflight and self._meta().idle:
            self._work().wait_for_finished_load(IDLE_LOAD_WAIT_S)
        sending, recving = super().get_finished(finished_req_ids)
        self._inflight -= recving or set()
        return sending, recving

    def get_kv_connector_stats(self) -> OffloadStats | None:
        if self.worker is None:
            return None
        stats = self.worker.get_kv_connector_stats()
        return OffloadStats(dict(stats.data)) if stats is not None else None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        meta = self._work().build_connector_worker_meta()
        assert meta is None or isinstance(meta, KVConnectorWorkerMetadata)
        return meta

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> OffloadStats:
        return OffloadStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> OffloadPromMetrics:
        return OffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- scheduler side ------------------------------------------------------------------------

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._requests[request.request_id] = request
        block_ids = list(blocks.get_block_ids()[0])
        if self._sched().update_state_after_alloc(request, block_ids, num_external_tokens):
            self._loading.add(request.request_id)

    def build_connector_meta(self, scheduler_output_: Any) -> KVConnectorMetadata:
        out = scheduler_output(scheduler_output_, self._requests, self._kv_cache_manager)
        meta = self._sched().build_connector_meta(out)
        assert isinstance(meta, KVConnectorMetadata)  # built as OffloadMetadataForVllm
        return meta

    def update_connector_output(self, connector_output_: Any) -> None:
        self._loading -= connector_output_.finished_recving or set()
        self._sched().update_connector_output(connector_output(connector_output_))

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """The load's tokens by the tier each chunk comes from (vLLM's
        `vllm:prompt_tokens_cached_by_source`): cpu host, disk disk, a peer's p2p, a shared
        store external_unspecified."""
        split = self._sched().hit_sources(request.request_id, num_external_tokens)
        return {CacheHitSource(source): n for source, n in split.items()}

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        saving, params = self._sched().request_finished(request, block_ids)
        # A load still writing into its blocks: vLLM frees them when it reports finished.
        return saving or request.request_id in self._loading, params

    def take_events(self) -> list[Any]:
        return [to_vllm_event(e) for e in self._sched().take_events()]

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_work()

    def reset_cache(self) -> bool | None:
        return self._sched().reset_cache()
