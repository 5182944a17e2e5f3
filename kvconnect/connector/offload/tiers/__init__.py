"""Storage tiers of the offload connector, made by kind: `cpu`, `disk`, `redis`.

Each tier class states its own facts (`kind`, `medium` in events, `shared` across instances),
builds itself from its `TierConfig` and owns its storage layout; the connector's halves make
tiers only through `create_tier` and talk to them only through `tiers.base.Tier`.
"""

from __future__ import annotations

import importlib

from kvconnect.connector.offload.common import TierConfig
from kvconnect.connector.offload.tiers.base import Tier, TierPlacement

_CLASSES = {
    "cpu": ("kvconnect.connector.offload.tiers.cpu", "CpuTier"),
    "disk": ("kvconnect.connector.offload.tiers.disk", "DiskTier"),
    "redis": ("kvconnect.connector.offload.tiers.redis", "RedisTier"),
}


def tier_class(kind: str) -> type[Tier]:
    """The class of tier `kind` (imported on first use: redis pulls in its client)."""
    module, name = _CLASSES[kind]
    cls: type[Tier] = getattr(importlib.import_module(module), name)
    return cls


def create_tier(config: TierConfig, placement: TierPlacement) -> Tier:
    """The tier `config` describes, as seen from `placement` (a worker rank, or the scheduler)."""
    return tier_class(config.kind).from_config(config, placement)


__all__ = ["Tier", "TierPlacement", "create_tier", "tier_class"]
