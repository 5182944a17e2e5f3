"""MultiConnector: several connectors behind one, in priority order (vLLM's semantics).

Configured with `kv_connector_extra_config["connectors"]`: a list of child `KVTransferConfig`
dicts (a child inherits `kv_role` and `engine_id` unless it sets them).

- Metadata both ways holds one slot per child: `MultiKVConnectorMetadata.metadata[i]` goes to
  child i on the workers; `MultiKVConnectorWorkerMetadata.metadata[i]` comes back to child i on
  the scheduler, folded slot by slot. So each child's worker-side events reach its own
  scheduler half, and `take_events` yields every child's events in child order.
- Loads come from the first child that reports matched tokens; saves go to every child.
- A request with several async savers is reported in `finished_sending` once, after the last
  of them: the scheduler side counts the extra savers and sends the counts to the workers in
  `extra_async_saves`, where `get_finished` holds back all but the last report.
- `update_connector_output` gives each child its own copy of the output with its own slot;
  the shared output is never changed.
- `shutdown` reaches every child even if one raises, then re-raises the last error.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvconnect.config import KVTransferConfig
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
from kvconnect.connector.registry import KVConnectorFactory
from kvconnect.events import KVCacheEvent

logger = logging.getLogger(__name__)


@dataclass
class MultiKVConnectorMetadata(KVConnectorMetadata):
    metadata: tuple[KVConnectorMetadata, ...]
    extra_async_saves: dict[str, int] | None = None


@dataclass
class MultiKVConnectorWorkerMetadata(KVConnectorWorkerMetadata):
    metadata: tuple[KVConnectorWorkerMetadata | None, ...]

    def aggregate(self, other: KVConnectorWorkerMetadata) -> MultiKVConnectorWorkerMetadata:
        if not isinstance(other, MultiKVConnectorWorkerMetadata):
            raise TypeError(f"cannot aggregate with {type(other).__name__}")
        if len(other.metadata) != len(self.metadata):
            raise ValueError(f"slot counts differ: {len(self.metadata)} and {len(other.metadata)}")
        slots: list[KVConnectorWorkerMetadata | None] = []
        for mine, theirs in zip(self.metadata, other.metadata, strict=True):
            if mine is None or theirs is None:
                slots.append(theirs if mine is None else mine)
            else:
                slots.append(mine.aggregate(theirs))
        return MultiKVConnectorWorkerMetadata(tuple(slots))


@dataclass
class MultiKVConnectorStats(KVConnectorStats):
    """Per-child stats keyed `"<index>:<class name>"`, so two children of one class stay apart."""

    data: dict[str, Any] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorStats) -> MultiKVConnectorStats:
        for key, stats in other.data.items():
            mine = self.data.get(key)
            self.data[key] = stats if mine is None else mine.aggregate(stats)
        return self

    def reduce(self) -> dict[str, Any]:
        return {key: stats.reduce() for key, stats in self.data.items()}

    def reset(self) -> None:
        for stats in self.data.values():
            stats.reset()

    def is_empty(self) -> bool:
        return all(stats.is_empty() for stats in self.data.values())


def child_configs(config: KVTransferConfig) -> list[KVTransferConfig]:
    """The children's transfer configs from `kv_connector_extra_config["connectors"]`."""
    raw = config.kv_connector_extra_config.get("connectors")
    if not isinstance(raw, list) or not raw:
        raise ValueError(
            "MultiConnector: kv_connector_extra_config['connectors'] must be a non-empty list "
            f"of KVTransferConfig objects, got {raw!r}"
        )
    children = []
    for i, child in enumerate(raw):
        if not isinstance(child, Mapping):
            raise ValueError(f"MultiConnector: connectors[{i}] must be an object, got {child!r}")
        inherited = {"kv_role": config.kv_role, "engine_id": config.engine_id}
        children.append(KVTransferConfig.from_dict({**inherited, **child}))
    return children


class MultiConnector(KVConnectorBase):
    def __init__(self, context: KVConnectorContext, role: KVConnectorRole) -> None:
        super().__init__(context, role)
        self._connectors: list[KVConnectorBase] = [
            KVConnectorFactory.create_connector(context.for_child(child), role)
            for child in child_configs(context.kv_transfer_config)
        ]
        self._requests_to_connector: dict[str, int] = {}  # scheduler: who loads a request
        self._extra_async_saves: dict[str, int] = {}  # both sides: savers beyond the first

    @property
    def connectors(self) -> tuple[KVConnectorBase, ...]:
        return tuple(self._connectors)

    @property
    def num_tracked_requests(self) -> int:
        """Requests this MultiConnector still keeps state for (a chosen loader, savers to
        count down); 0 once every request it saw has finished and been reported."""
        return len(self._requests_to_connector) + len(self._extra_async_saves)

    # -- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        for c in self._connectors:
            c.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        if not isinstance(connector_metadata, MultiKVConnectorMetadata):
            raise TypeError(f"expected MultiKVConnectorMetadata, got {connector_metadata!r}")
        if len(connector_metadata.metadata) != len(self._connectors):
            raise ValueError(
                f"metadata has {len(connector_metadata.metadata)} slots for "
                f"{len(self._connectors)} connectors"
            )
        for req_id, extra in (connector_metadata.extra_async_saves or {}).items():
            self._extra_async_saves[req_id] = self._extra_async_saves.get(req_id, 0) + extra
        for c, meta in zip(self._connectors, connector_metadata.metadata, strict=True):
            c.bind_connector_metadata(meta)
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        for c in self._connectors:
            c.clear_connector_metadata()
        super().clear_connector_metadata()

    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        for c in self._connectors:
            c.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for c in self._connectors:
            c.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any = None, **kwargs: Any
    ) -> None:
        for c in self._connectors:
            c.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        for c in self._connectors:
            c.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending: set[str] = set()
        recving: set[str] = set()
        for c in self._connectors:
            child_sending, child_recving = c.get_finished(finished_req_ids)
            recving |= child_recving or set()
            for req_id in child_sending or ():
                extra = self._extra_async_saves.get(req_id, 0)
                if extra == 0:
                    sending.add(req_id)  # the last saver to finish
                elif extra == 1:
                    del self._extra_async_saves[req_id]
                else:
                    self._extra_async_saves[req_id] = extra - 1
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors: set[int] = set()
        for c in self._connectors:
            errors |= c.get_block_ids_with_load_errors()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        stats = MultiKVConnectorStats()
        for i, c in enumerate(self._connectors):
            child = c.get_kv_connector_stats()
            if child is not None:
                stats.data[f"{i}:{type(c).__name__}"] = child
        return stats if stats.data else None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        slots = tuple(c.build_connector_worker_meta() for c in self._connectors)
        if all(s is None for s in slots):
            return None
        return MultiKVConnectorWorkerMetadata(slots)

    def shutdown(self) -> None:
        error: BaseException | None = None
        for c in self._connectors:
            try:
                c.shutdown()
            except Exception as e:
                logger.exception("MultiConnector: %s.shutdown() failed", type(c).__name__)
                error = e
        if error is not None:
            raise error

    # -- scheduler side -------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        chosen: tuple[int, bool] | None = None
        for i, c in enumerate(self._connectors):
            num_tokens, load_async = c.get_num_new_matched_tokens(request, num_computed_tokens)
            if num_tokens is None:
                self._requests_to_connector.pop(request.request_id, None)
                return None, False
            if chosen is None and num_tokens > 0:
                self._requests_to_connector[request.request_id] = i
                chosen = (num_tokens, load_async)
        return chosen if chosen is not None else (0, False)

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        chosen = self._requests_to_connector.get(request.request_id, -1)
        for i, c in enumerate(self._connectors):
            if i == chosen:
                c.update_state_after_alloc(request, block_ids, num_external_tokens)
            else:
                c.update_state_after_alloc(request, [], 0)

    def get_external_cache_hit_sources(
        self, request: ConnectorRequest, num_external_tokens: int
    ) -> dict[str, int]:
        chosen = self._requests_to_connector.get(request.request_id)
        if chosen is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return self._connectors[chosen].get_external_cache_hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        metas = tuple(c.build_connector_meta(scheduler_output) for c in self._connectors)
        extra, self._extra_async_saves = self._extra_async_saves or None, {}
        return MultiKVConnectorMetadata(metas, extra)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        multi = connector_output.kv_connector_worker_meta
        if multi is not None and not isinstance(multi, MultiKVConnectorWorkerMetadata):
            raise TypeError(f"expected MultiKVConnectorWorkerMetadata, got {type(multi).__name__}")
        for i, c in enumerate(self._connectors):
            slot = None if multi is None else multi.metadata[i]
            c.update_connector_output(_child_view(connector_output, slot))

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        num_async = 0
        params: dict[str, Any] = {}
        for c in self._connectors:
            is_async, child_params = c.request_finished(request, block_ids)
            num_async += bool(is_async)
            for key, value in (child_params or {}).items():
                if key in params:
                    raise RuntimeError(
                        f"Key clash in kv_transfer_params from multiple connectors: {key!r}"
                    )
                params[key] = value
        if num_async > 1:
            self._extra_async_saves[request.request_id] = num_async - 1
        self._requests_to_connector.pop(request.request_id, None)
        return num_async > 0, params or None

    def take_events(self) -> Iterator[KVCacheEvent]:
        for c in self._connectors:
            yield from c.take_events()

    def get_finished_count(self) -> int | None:
        return None

    def reset_cache(self) -> bool | None:
        results = [c.reset_cache() for c in self._connectors]
        return all(r is not False for r in results)

    def health(self) -> str | None:
        return next((why for c in self._connectors if (why := c.health()) is not None), None)


def _child_view(
    output: KVConnectorOutput, slot: KVConnectorWorkerMetadata | None
) -> KVConnectorOutput:
    """A copy of `output` for one child, with that child's metadata slot and its own sets."""
    return KVConnectorOutput(
        finished_sending=None if output.finished_sending is None else set(output.finished_sending),
        finished_recving=None if output.finished_recving is None else set(output.finished_recving),
        kv_connector_stats=output.kv_connector_stats,
        kv_connector_worker_meta=slot,
        invalid_block_ids=set(output.invalid_block_ids),
        expected_finished_count=output.expected_finished_count,
    )
