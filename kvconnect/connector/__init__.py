"""The KV connector framework. See `base.py` for the contract and the per-step call order.

This package re-exports the interface (`base`) and the registry only, so importing it imports
no connector: `aggregator`, `events`, `multi`, `step` and `offload` are imported by name.
"""

from kvconnect.connector.base import (
    ConnectorRequest,
    KVConnectorBase,
    KVConnectorContext,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVConnectorStats,
    KVConnectorWorkerMetadata,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)
from kvconnect.connector.registry import KVConnectorFactory

__all__ = [
    "ConnectorRequest",
    "KVConnectorBase",
    "KVConnectorContext",
    "KVConnectorFactory",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVConnectorWorkerMetadata",
    "NewRequestData",
    "ScheduledRequest",
    "SchedulerOutput",
]
