"""What kvconnect's offload connector needs from vLLM, in kvconnect's terms, and back.

    vLLM                                  kvconnect
    VllmConfig (+ TP rank)          ->    KVConnectorContext (world size, rank, block size,
                                          model identity, wire form of block hashes)
    KVTransferConfig                ->    kvconnect KVTransferConfig (the extra config as is)
    per-layer KV cache tensors      ->    kvconnect's paged views (layout.py, from vLLM's
                                          layout descriptor and KV cache specs)
    SchedulerOutput + Requests      ->    kvconnect SchedulerOutput (tokens computed this step,
                                          block tables, new requests' tokens and hashes)
    KVConnectorOutput               ->    kvconnect KVConnectorOutput
    kvconnect events                ->    vLLM's BlockStored / BlockRemoved / AllBlocksCleared
    kvconnect step and worker meta  ->    classes that are both kvconnect's and vLLM's type
                                          (the halves build them: no field is copied)
    kvconnect stats                 ->    a subclass of vLLM's KVConnectorStats

Block hashes are vLLM's own (`Request.block_hashes`): kvconnect never re-hashes a vLLM
request, so chunk keys and events agree with vLLM's prefix cache whatever its hash settings.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import vllm
import vllm.envs
from vllm.distributed import kv_events as vllm_events
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata as VllmMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole as VllmRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorWorkerMetadata as VllmWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics as VllmPromMetrics,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorStats as VllmStats,
)

from kvconnect.config import KVTransferConfig
from kvconnect.connector.base import KVConnectorContext
from kvconnect.connector.offload.common import OffloadMetadata, OffloadWorkerMetadata
from kvconnect.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvconnect.messages import (
    KVConnectorOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)
from kvconnect.model.source import weights_identity

logger = logging.getLogger(__name__)

SUPPORTED_VLLM = ("0.32.", "0.33.")
"""vLLM releases this adapter is tested against (`make test-vllm`)."""


def check_version() -> None:
    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        logger.warning(
            "kvconnect.vllm is tested with vLLM %s; this is vLLM %s",
            ", ".join(v + "x" for v in SUPPORTED_VLLM),
            vllm.__version__,
        )


def connector_context(vllm_config: Any, role: VllmRole) -> KVConnectorContext:
    """The connector's view of this vLLM engine (and, for a worker, of its TP rank)."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ValueError(
            "kvconnect OffloadConnector: pipeline parallelism "
            f"({parallel.pipeline_parallel_size} stages) is not supported"
        )
    world_size = parallel.tensor_parallel_size
    rank = 0
    if role == VllmRole.WORKER:
        from vllm.distributed import parallel_state

        if parallel_state.model_parallel_is_initialized():
            rank = parallel_state.get_tensor_model_parallel_rank()
        else:  # a worker built outside vLLM's process groups (a harness): the config's rank
            rank = parallel.rank % world_size
    vllm_transfer = vllm_config.kv_transfer_config
    transfer = KVTransferConfig(
        kv_connector=vllm_transfer.kv_connector,
        engine_id=vllm_transfer.engine_id,
        kv_role=vllm_transfer.kv_role,
        kv_connector_extra_config=dict(vllm_transfer.kv_connector_extra_config or {}),
    )
    model = vllm_config.model_config
    return KVConnectorContext(
        kv_transfer_config=transfer,
        world_size=world_size,
        rank=rank,
        block_size=vllm_config.cache_config.block_size,
        # The chunk keys' model part: the same weights at the same precision share entries.
        model_name=f"{model.model}@{str(model.dtype).removeprefix('torch.')}",
        model_fingerprint=model_fingerprint(vllm_config),
        hash_algorithm=vllm_config.cache_config.prefix_caching_hash_algo,
        data_parallel_rank=parallel.data_parallel_rank,
        int_block_hashes=bool(vllm.envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES),
    )


def model_fingerprint(vllm_config: Any) -> str:
    """What tells this engine's KV apart from another's under the same model name, from
    fields vLLM has already read (nothing is loaded): the checkpoint (revision, and for a
    local directory its files' identity), its HF config, quantization, the model and KV cache
    dtypes. Fields a vLLM release lacks count as empty."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    hf_config = getattr(model, "hf_config", None)
    parts = [
        str(getattr(model, name, ""))
        for name in ("model", "revision", "tokenizer", "quantization", "dtype")
    ]
    parts.append(str(getattr(cache, "cache_dtype", "")))
    try:
        parts.append(hf_config.to_json_string() if hf_config is not None else "")
    except (AttributeError, TypeError, ValueError):  # a config that does not serialise
        parts.append(repr(hf_config))
    if os.path.isdir(str(model.model)):  # a local checkpoint: its files, not just its path
        try:
            parts.append(weights_identity(str(model.model)))
        except (ValueError, OSError) as e:
            logger.warning("kvconnect: no weights identity for %s (%s)", model.model, e)
    return "\0".join(parts)


def scheduler_output(so: Any, requests: dict[str, Any], kv_cache_manager: Any) -> SchedulerOutput:
    """This step in kvconnect's terms, for the requests the connector tracks (`requests`, by
    id: vLLM's Request objects). Positions are those before the step: vLLM calls
    `build_connector_meta` before it advances `num_computed_tokens`."""
    out = SchedulerOutput(finished_req_ids=set(so.finished_req_ids))
    state = so.kv_connector_block_state

    def block_ids(req_id: str) -> list[int]:
        groups = state.get_block_ids(req_id) if state is not None else None
        if groups is None:
            groups = kv_cache_manager.get_block_ids(req_id)
        return list(groups[0])

    for new in so.scheduled_new_reqs:
        req = requests.get(new.req_id)
        if req is not None:
            out.scheduled_new_reqs.append(
                NewRequestData(
                    new.req_id,
                    list(req.all_token_ids),
                    list(req.block_hashes),
                    [],
                    req.num_computed_tokens,
                    req.cache_salt,
                )
            )
    for req_id, num in so.num_scheduled_tokens.items():
        req = requests.get(req_id)
        if req is None:
            continue
        start = req.num_computed_tokens
        out.scheduled.append(
            ScheduledRequest(
                req_id, list(req.all_token_ids[start : start + num]), start, block_ids(req_id)
            )
        )
        out.num_scheduled_tokens[req_id] = num
    return out


def connector_output(output: Any) -> KVConnectorOutput:
    return KVConnectorOutput(
        finished_sending=output.finished_sending,
        finished_recving=output.finished_recving,
        kv_connector_worker_meta=output.kv_connector_worker_meta,
        invalid_block_ids=set(output.invalid_block_ids or ()),
    )


_VLLM_CLASSES: dict[type[Any], Any] = {
    BlockStored: vllm_events.BlockStored,
    BlockRemoved: vllm_events.BlockRemoved,
    AllBlocksCleared: vllm_events.AllBlocksCleared,
}


def to_vllm_event(event: KVCacheEvent) -> Any:
    """The same event as vLLM's own struct (what vLLM's publisher encodes), field by field."""
    cls = _VLLM_CLASSES[type(event)]
    fields = {f: getattr(event, f) for f in cls.__struct_fields__ if hasattr(event, f)}
    return cls(**fields)


class OffloadMetadataForVllm(OffloadMetadata, VllmMetadata):
    """kvconnect's step metadata, every field of it, as vLLM's type: the scheduler half
    builds it (its `metadata_class`), so nothing is copied between the two."""


class OffloadWorkerMetadataForVllm(OffloadWorkerMetadata, VllmWorkerMetadata):
    """kvconnect's worker metadata (events per rank, pending I/O), as vLLM's type: the
    worker half builds it (its `metadata_class`)."""


class OffloadStats(VllmStats):
    """The connector's counters (chunks and bytes per tier, hits, errors) for vLLM's stats
    logging: summed across workers and intervals."""

    def aggregate(self, other: VllmStats) -> OffloadStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def reset(self) -> None:
        self.data.clear()

    def is_empty(self) -> bool:
        return not self.data


class OffloadPromMetrics(VllmPromMetrics):
    """The same counters in vLLM's /metrics, as `kvconnect:offload_<name>_total` (e.g.
    `kvconnect:offload_cpu_hits_total`, `..._disk_bytes_loaded_total`), with vLLM's labels
    (model name, engine). A counter is made the first time its name is reported."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._counters: dict[str, Any] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            counter = self._counters.get(key)
            if counter is None:
                counter = self._counters[key] = self._counter_cls(
                    name=f"kvconnect:offload_{key}",
                    documentation=f"kvconnect OffloadConnector: {key.replace('_', ' ')}.",
                    labelnames=self._labelnames,
                )
            counter.labels(*self.per_engine_labelvalues[engine_idx]).inc(value)
