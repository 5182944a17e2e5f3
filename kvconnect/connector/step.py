"""A worker's part of one engine step, in the designed order, written once.

    run_worker_step(connector, metadata, finished_req_ids, forward)

        bind_connector_metadata(metadata)
        start_load_kv(forward_context)
        forward(hooks)                       per layer, from inside the model:
                                               hooks.before_attention -> wait_for_layer_load
                                               hooks.after_attention  -> save_kv_layer
        wait_for_save()
        get_finished(finished_req_ids)
        get_block_ids_with_load_errors()
        get_kv_connector_stats()
        build_connector_worker_meta()
        clear_connector_metadata()           also when a call above raised

The engine's worker and every test loop call this; nothing else sequences the worker hooks.
The result is the worker's `KVConnectorOutput` for the executor to fold, or None when it carries
no news (most decode steps), so that nothing crosses the pipe for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from kvconnect.connector.base import KVConnectorBase
from kvconnect.messages import KVConnectorMetadata, KVConnectorOutput

T = TypeVar("T")


class ConnectorLayerHooks:
    """What the model calls around each layer's attention (see `model.llama.LayerHooks`)."""

    def __init__(self, connector: KVConnectorBase, attn_metadata: Any = None) -> None:
        self.connector = connector
        self.attn_metadata = attn_metadata

    def before_attention(self, layer_name: str) -> None:
        self.connector.wait_for_layer_load(layer_name)

    def after_attention(self, layer_name: str, kv_cache: Any) -> None:
        self.connector.save_kv_layer(layer_name, kv_cache, self.attn_metadata)


def run_worker_step(
    connector: KVConnectorBase,
    metadata: KVConnectorMetadata,
    finished_req_ids: set[str],
    forward: Callable[[ConnectorLayerHooks], T],
    *,
    forward_context: Any = None,
    attn_metadata: Any = None,
) -> tuple[T, KVConnectorOutput | None]:
    """Run `forward` inside the connector's worker hooks; (its result, this worker's output)."""
    connector.bind_connector_metadata(metadata)
    try:
        connector.start_load_kv(forward_context)
        result = forward(ConnectorLayerHooks(connector, attn_metadata))
        connector.wait_for_save()
        finished_sending, finished_recving = connector.get_finished(finished_req_ids)
        output = KVConnectorOutput(
            finished_sending=finished_sending,
            finished_recving=finished_recving,
            invalid_block_ids=connector.get_block_ids_with_load_errors(),
            kv_connector_stats=connector.get_kv_connector_stats(),
            kv_connector_worker_meta=connector.build_connector_worker_meta(),
        )
    finally:
        connector.clear_connector_metadata()
    return result, None if output.is_empty() else output
