"""The KV connector framework. See `base.py` for the contract and the per-step call order.

This package re-exports the interface (`base`, everything its `__all__` names) and the registry
only, so importing it imports no connector: `aggregator`, `events`, `multi`, `step` and
`offload` are imported by name.
"""

from kvconnect.connector.base import *  # noqa: F403
from kvconnect.connector.base import __all__ as _interface
from kvconnect.connector.registry import KVConnectorFactory

__all__ = [*_interface, "KVConnectorFactory"]
