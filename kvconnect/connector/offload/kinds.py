"""The kinds of storage tier, and what each one is in KV events: one vocabulary for the
connector's config (`"kind": "cpu"`), its tiers, its events and the router that reads them.

    kind     medium      locality   shared
    cpu      CPU         None       no      host memory of the instance
    disk     DISK        None       no      local disk of the instance
    redis    EXTERNAL    None       yes     a Redis server or Redis Cluster several instances use

The mediums are today's wire strings; vLLM 0.33 names disk and redis `STORAGE` with a
locality (`LOCAL`, `REMOTE`). Moving to those changes the bytes every reader sees, so it is
its own change: then only this table changes, and `locality` stops being None.

Imports nothing heavy (no torch, no redis client): the router imports it.
"""

from __future__ import annotations

from enum import StrEnum

from kvconnect.events import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_EXTERNAL


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
        """Where the tier is, beside its medium (None: the medium says it, as today)."""
        return None

    @property
    def shared(self) -> bool:
        """Several instances see the same entries (each announces what it wrote there)."""
        return self is TierKind.REDIS

    @classmethod
    def of_medium(cls, medium: str | None) -> TierKind | None:
        """The kind whose tiers announce `medium`; None for the engine's own GPU cache (its
        events' medium is "GPU" or unset) and for mediums no tier announces."""
        return next((kind for kind, m in _MEDIUMS.items() if m == medium), None)


_MEDIUMS = {TierKind.CPU: MEDIUM_CPU, TierKind.DISK: MEDIUM_DISK, TierKind.REDIS: MEDIUM_EXTERNAL}
"""kind -> medium: every kind has exactly one (a Redis Cluster is a redis tier too)."""

KIND_NAMES = tuple(kind.value for kind in TierKind)
"""("cpu", "disk", "redis"): what a config's "kind" may say."""
