"""`OffloadConnector`: the LMCache-style connector, one class with a scheduler half and a worker
half (see scheduler.py and worker.py); only the role's half exists in a process.

    {"kv_connector": "OffloadConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"chunk_size": 256, "tiers": [
         {"kind": "cpu", "max_bytes": 1073741824},
         {"kind": "disk", "path": "/var/cache/kv", "max_bytes": 10737418240},
         {"kind": "redis", "url": "redis://127.0.0.1:6379/0"}]}}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvconnect.connector.base import (
    ConnectorRequest,
    KVConnectorBase,
    KVConnectorContext,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVConnectorStats,
    KVConnectorWorkerMetadata,
    SchedulerOutput,
)
from kvconnect.connector.offload.common import OffloadConfig, OffloadMetadata
from kvconnect.connector.offload.scheduler import OffloadScheduler
from kvconnect.connector.offload.worker import OffloadWorker
from kvconnect.events import KVCacheEvent


class OffloadHalves:
    """The half of the connector a process has, for both front ends (this one and the vLLM
    plugin's, kvconnect/vllm/connector.py): a call meant for the other half is an error."""

    scheduler: OffloadScheduler | None
    worker: OffloadWorker | None
    _get_connector_metadata: Callable[[], Any]
    """From the connector base class this is mixed into (declared only, so that the base
    class's method is the one found)."""

    def _sched(self) -> OffloadScheduler:
        if self.scheduler is None:
            raise RuntimeError("OffloadConnector: a scheduler-side call on a worker instance")
        return self.scheduler

    def _work(self) -> OffloadWorker:
        if self.worker is None:
            raise RuntimeError("OffloadConnector: a worker-side call on a scheduler instance")
        return self.worker

    def _meta(self) -> OffloadMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, OffloadMetadata)
        return meta

    # The calls both front ends pass through unchanged.

    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        self._work().start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: they finish before the request's first forward

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any = None, **kwargs: Any
    ) -> None:
        return None  # whole chunks are copied out in wait_for_save

    def wait_for_save(self) -> None:
        self._work().wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._work().get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().get_block_ids_with_load_errors()

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()


class OffloadConnector(OffloadHalves, KVConnectorBase):
    def __init__(self, context: KVConnectorContext, role: KVConnectorRole) -> None:
        super().__init__(context, role)
        self.config = OffloadConfig.from_extra_config(
            context.kv_transfer_config.kv_connector_extra_config, context.block_size
        )
        self.scheduler: OffloadScheduler | None = None
        self.worker: OffloadWorker | None = None
        if role is KVConnectorRole.SCHEDULER:
            self.scheduler = OffloadScheduler(context, self.config)
        else:
            self.worker = OffloadWorker(context, self.config)

    # worker side
    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        self._work().register_kv_caches(kv_caches)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._work().get_kv_connector_stats()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._work().build_connector_worker_meta()

    # scheduler side
    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        self._sched().update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(connector_output)

    def get_external_cache_hit_sources(
        self, request: ConnectorRequest, num_external_tokens: int
    ) -> dict[str, int]:
        return self._sched().hit_sources(request.request_id, num_external_tokens)

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Chunks are copied out as they are computed; what was computed past them is saved
        # in the next step, the blocks held till then. A P/D prefill's answer names where
        # its (leased) chunks are.
        return self._sched().request_finished(request, block_ids)

    def take_events(self) -> list[KVCacheEvent]:
        return self._sched().take_events()

    def reset_cache(self) -> bool | None:
        return self._sched().reset_cache()

    def health(self) -> str | None:
        return self.scheduler.health() if self.scheduler is not None else None
