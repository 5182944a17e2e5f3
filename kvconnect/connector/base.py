"""The KV connector interface: roles, the context a connector is built with, its hooks.

A connector class is instantiated once per role and process: one SCHEDULER-role instance in
the scheduler, one WORKER-role instance in each tensor-parallel worker. Method names and
contracts are vLLM's (KVConnectorBase_V1), so a connector author who knows vLLM feels at home.

One engine step, in this order (callers in brackets):

  [scheduler] for each waiting request:
      get_num_new_matched_tokens(request, num_computed_tokens) -> (num_tokens | None, is_async)
      ... blocks allocated ...
      update_state_after_alloc(request, block_ids, num_external_tokens)
      get_external_cache_hit_sources(request, num_external_tokens)   where the load comes from
  [scheduler] build_connector_meta(scheduler_output) -> KVConnectorMetadata     (sent to workers)
  [worker]    bind_connector_metadata(meta); start_load_kv(ctx)
              per layer: wait_for_layer_load(name) ... save_kv_layer(name, kv, attn_metadata)
              wait_for_save(); get_finished(finished_req_ids); get_block_ids_with_load_errors()
              get_kv_connector_stats(); build_connector_worker_meta(); clear_connector_metadata()
  [executor]  KVOutputAggregator folds the workers' KVConnectorOutputs into one
  [scheduler] update_connector_output(output); finished transfers; request_finished(req, ids)
  [scheduler] take_events()   after the block pool's events; both go out as one KVEventBatch
  [any]       health()        what keeps the connector from progress (serve's /health)

Worker -> scheduler data travels only in `KVConnectorOutput`. Its slot for a connector's own
state is `kv_connector_worker_meta` (a `KVConnectorWorkerMetadata`, folded across ranks with
`aggregate`); KV cache events of worker-side connectors ride in it too (see `events.py`), so
there is no events field. Scheduler-side and worker-side code share only the message types
of `kvconnect.messages` (re-exported here). `connector/step.py` runs the worker's part of a
step in the order above; nothing else sequences those hooks.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from kvconnect.config import KVTransferConfig
from kvconnect.events import KVCacheEvent
from kvconnect.hashing import DEFAULT_ALGORITHM
from kvconnect.messages import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorStats,
    KVConnectorWorkerMetadata,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)


class CacheHitSource(enum.StrEnum):
    """Where cached prompt tokens' KV came from: vLLM's names (`vllm.v1.metrics.
    cache_hit_source`), as `usage` and `vllm:prompt_tokens_cached_by_source` give them."""

    DEVICE = "device"
    """The engine's own prefix cache."""
    HOST = "host"
    P2P = "p2p"
    """Pulled from another instance."""
    DISK = "disk"
    EXTERNAL_UNSPECIFIED = "external_unspecified"
    """A shared store, or a connector that does not say."""


class KVConnectorRole(enum.Enum):
    """Where a connector instance lives."""

    SCHEDULER = 0
    WORKER = 1


class ConnectorRequest(Protocol):
    """What scheduler-side connector methods read from a request."""

    @property
    def request_id(self) -> str: ...
    @property
    def all_token_ids(self) -> Sequence[int]: ...
    @property
    def block_hashes(self) -> Sequence[bytes]: ...
    @property
    def kv_transfer_params(self) -> dict[str, Any] | None: ...
    @property
    def cache_salt(self) -> str | None: ...


@dataclass(frozen=True)
class KVConnectorContext:
    """What the engine tells a connector about itself when it builds one."""

    kv_transfer_config: KVTransferConfig
    """This connector's transfer config (for a MultiConnector child: the child's own)."""
    world_size: int = 1
    """Number of tensor-parallel workers, each running a WORKER-role instance."""
    rank: int = 0
    """This worker's tensor-parallel rank (0 for the scheduler-role instance)."""
    block_size: int = 16
    """Tokens per KV cache block."""
    model_name: str = ""
    """Model identity, part of any storage key shared across instances."""
    model_fingerprint: str = ""
    """What else tells this model's KV apart from another's under the same name: the weights'
    identity, their config and dtype, the KV layout (see `model.source.weights_identity`);
    part of storage keys with the name."""
    hash_algorithm: str = DEFAULT_ALGORITHM
    """Block hash algorithm (see `kvconnect.hashing`)."""
    hash_seed: str | None = None
    """Block hash seed string; None is vLLM's rule (`kvconnect.hashing.resolve_seed`)."""
    data_parallel_rank: int = 0
    """Which data-parallel engine this is."""
    int_block_hashes: bool = True
    """Events carry block hashes as 64-bit ints (vLLM's default) or as raw digests."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"KVConnectorContext.world_size={self.world_size!r}: must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"KVConnectorContext.rank={self.rank!r}: must be in [0, {self.world_size})"
            )
        if self.block_size < 1:
            raise ValueError(f"KVConnectorContext.block_size={self.block_size!r}: must be >= 1")

    def for_child(self, kv_transfer_config: KVTransferConfig) -> KVConnectorContext:
        return replace(self, kv_transfer_config=kv_transfer_config)


class KVConnectorBase(ABC):
    """Base of every KV connector. Abstract methods are the ones every connector must have;
    every other hook has a no-op default."""

    def __init__(self, context: KVConnectorContext, role: KVConnectorRole) -> None:
        self._context = context
        self._kv_transfer_config = context.kv_transfer_config
        self._role = role
        self._connector_metadata: KVConnectorMetadata | None = None

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    # -- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        """Called once with each layer's paged KV cache tensor (this worker's shard)."""
        return None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Store this step's metadata; called before the forward pass."""
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """Forget this step's metadata; always the last connector call of a worker step."""
        self._connector_metadata = None

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        if self._connector_metadata is None:
            raise RuntimeError(f"{type(self).__name__}: no connector metadata is bound")
        return self._connector_metadata

    @abstractmethod
    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        """Start loading the KV the bound metadata asks for (possibly asynchronously)."""

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until `layer_name`'s KV is loaded (called inside the layer)."""

    @abstractmethod
    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any = None, **kwargs: Any
    ) -> None:
        """Start saving `layer_name`'s KV (called inside the layer, after attention)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until saves no longer need the paged buffer (it may be overwritten next)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(ids whose async save finished, ids whose async load finished) on this worker.
        A saving id must be one the scheduler handed over as finished, now or earlier."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed; their request must still be reported as finished."""
        return set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """This step's worker -> scheduler metadata; drains it (the next call reports only
        newer news). None: nothing to say."""
        return None

    def shutdown(self) -> None:
        """Finish or cancel outstanding work and release resources."""
        return None

    # -- scheduler side -------------------------------------------------------------------------

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """(tokens beyond `num_computed_tokens` loadable now, whether the load is async).
        None: ask again later. May be called repeatedly for one request: no side effects."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Blocks were allocated for `request`; load `num_external_tokens` into them if > 0."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's metadata for the workers; resets the per-step state. Must not change
        `scheduler_output`."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' aggregated output of the step. Do not keep references into it."""
        return None

    def get_external_cache_hit_sources(
        self, request: ConnectorRequest, num_external_tokens: int
    ) -> dict[str, int]:
        """The first `num_external_tokens` of the request's load (after
        `update_state_after_alloc`; again with fewer when part of it failed) by the
        `CacheHitSource` value of the tier they come from; non-zero counts summing to it."""
        return (
            {CacheHitSource.EXTERNAL_UNSPECIFIED.value: num_external_tokens}
            if num_external_tokens
            else {}
        )

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Called once per finished request, before its blocks are freed. (True, params):
        the connector frees them later, when the id comes back in `finished_sending`."""
        return False, None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """KV cache events gathered since the last call (drained)."""
        return ()

    def get_finished_count(self) -> int | None:
        """How many workers report each finished id; None means every worker."""
        return None

    def reset_cache(self) -> bool | None:
        """Drop what the connector caches; False if it could not."""
        return None

    def health(self) -> str | None:
        """Why the connector cannot make progress now (a worker's I/O stuck), or None; any
        thread may ask (serve's /health does)."""
        return None


__all__ = [
    "CacheHitSource",
    "ConnectorRequest",
    "KVConnectorBase",
    "KVConnectorContext",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVConnectorWorkerMetadata",
    "NewRequestData",
    "ScheduledRequest",
    "SchedulerOutput",
]
