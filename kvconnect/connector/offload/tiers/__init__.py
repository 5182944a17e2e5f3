"""Storage tiers of the offload connector, made by kind: `cpu`, `disk`, `redis`.

Each tier class states its kind (and so its medium in events and whether it is shared across
instances, see kinds.py), builds itself from its `TierConfig` and owns its storage layout; the
connector's halves make tiers only through `create_tier` and talk to them only through
`tiers.base.Tier` (a shared tier's follower of what it drops, too: `Tier.watch_removals`).
"""

from __future__ import annotations

import importlib

from kvconnect.connector.offload.common import TierConfig
from kvconnect.connector.offload.kinds import TierKind
from kvconnect.connector.offload.tiers.base import RemovalWatcher, Tier, TierPlacement

_CLASSES = {
    TierKind.CPU: ("kvconnect.connector.offload.tiers.cpu", "CpuTier"),
    TierKind.DISK: ("kvconnect.connector.offload.tiers.disk", "DiskTier"),
    TierKind.REDIS: ("kvconnect.connector.offload.tiers.redis", "RedisTier"),
}


def tier_class(kind: TierKind) -> type[Tier]:
    """The class of tier `kind` (imported on first use: redis pulls in its client)."""
    module, name = _CLASSES[kind]
    cls: type[Tier] = getattr(importlib.import_module(module), name)
    return cls


def create_tier(config: TierConfig, placement: TierPlacement) -> Tier:
    """The tier `config` describes, as seen from `placement` (a worker rank, or the scheduler)."""
    return tier_class(config.kind).from_config(config, placement)


__all__ = ["RemovalWatcher", "Tier", "TierKind", "TierPlacement", "create_tier", "tier_class"]
