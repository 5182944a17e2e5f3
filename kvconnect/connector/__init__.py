"""The KV connector framework: interface, aggregation, events in worker metadata, MultiConnector.

See `base.py` for the contract and the per-step call order.
"""

from kvconnect.connector.aggregator import KVOutputAggregator
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
    SchedulerOutput,
)
from kvconnect.connector.events import EventQuorum, KVEventsWorkerMetadata
from kvconnect.connector.multi import (
    MultiConnector,
    MultiKVConnectorMetadata,
    MultiKVConnectorStats,
    MultiKVConnectorWorkerMetadata,
)
from kvconnect.connector.registry import KVConnectorFactory

__all__ = [
    "ConnectorRequest",
    "EventQuorum",
    "KVConnectorBase",
    "KVConnectorContext",
    "KVConnectorFactory",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVConnectorWorkerMetadata",
    "KVEventsWorkerMetadata",
    "KVOutputAggregator",
    "MultiConnector",
    "MultiKVConnectorMetadata",
    "MultiKVConnectorStats",
    "MultiKVConnectorWorkerMetadata",
    "NewRequestData",
    "SchedulerOutput",
]
