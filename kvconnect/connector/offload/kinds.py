"""The kinds of storage tier, and what each one is in KV events: one vocabulary for the
connector's config (`"kind": "cpu"`), its tiers, its events and the router that reads them.

    kind     medium      locality   tier label        shared
    cpu      CPU         None       CPU               no      host memory of the instance
    disk     STORAGE     LOCAL      STORAGE/LOCAL     no      local disk of the instance
    redis    STORAGE     REMOTE     STORAGE/REMOTE    yes     a Redis (or Redis Cluster) several
                                                              instances use

These are vLLM 0.33's words (`medium` GPU/CPU/STORAGE, `locality` LOCAL/REMOTE), so readers
of vLLM's stream credit a tier as the tier it is: vllm-router 0.1.17 gives CPU its host credit
and STORAGE its disk credit (it used to take EXTERNAL for GPU); Dynamo 1.6.1 files CPU under
host and STORAGE/LOCAL under disk, and drops REMOTE events altogether (a shared store is not
its kind of tier), as `tests_peers` shows. kvconnect before 0.2 said DISK and EXTERNAL; its
readers still take those (`events.tier_of`).

Imports nothing heavy (no torch, no redis client): the router imports it.
"""

from __future__ import annotations

from enum import StrEnum

from kvconnect.events import (
    LOCALITY_LOCAL,
    LOCALITY_REMOTE,
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    tier_of,
)


class TierKind(StrEnum):
    """A tier's kind, as its config names it; its value is that name ("cpu")."""

    CPU = "cpu"
    DISK = "disk"
    REDIS = "redis"

    @property
    def medium(self) -> str:
        """Its `medium` in BlockStored and BlockRemoved events."""
        return _MEDIUMS[self]

    @property
    def locality(self) -> str | None:
        """Its `locality` in events (None: unspecified, for the cpu tier as in vLLM)."""
        return _LOCALITIES[self]

    @property
    def tier(self) -> str:
        """Its label where events are read (`events.tier_of`): "CPU", "STORAGE/LOCAL", ..."""
        return tier_of(self.medium, self.locality)

    @property
    def shared(self) -> bool:
        """Several instances see the same entries (each announces what it wrote there)."""
        return self is TierKind.REDIS

    @classmethod
    def of_event(cls, medium: str | None, locality: str | None = None) -> TierKind | None:
        """The kind whose tiers announce (`medium`, `locality`), old names too; None for the
        engine's own GPU cache and for what no tier announces."""
        tier = tier_of(medium, locality)
        return next((kind for kind in cls if kind.tier == tier), None)


_MEDIUMS = {TierKind.CPU: MEDIUM_CPU, TierKind.DISK: MEDIUM_STORAGE, TierKind.REDIS: MEDIUM_STORAGE}
"""kind -> medium (a Redis Cluster is a redis tier too)."""
_LOCALITIES = {TierKind.CPU: None, TierKind.DISK: LOCALITY_LOCAL, TierKind.REDIS: LOCALITY_REMOTE}

KIND_NAMES = tuple(kind.value for kind in TierKind)
"""("cpu", "disk", "redis"): what a config's "kind" may say."""
