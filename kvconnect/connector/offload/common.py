"""What both halves of the offload connector share: settings, chunk identity, step messages.

A chunk is `chunk_size` consecutive tokens of a request, a multiple of the engine's block size,
starting at a multiple of `chunk_size`. It is stored once per TP rank (each rank holds its own
KV heads) under a key naming the model, the world size, the rank and the chained hash of the
chunk's last block, so the same prefix finds the same entries across requests and instances:

    tokens  [ chunk 0: blocks 0..15 | chunk 1: blocks 16..31 | ...]     chunk_size 256, block 16
    key     "<model>/<world_size>/<rank>/<hex hash of block 15>"         (then block 31, ...)

Chunk data on a rank: [num_layers, 2 (K, V), chunk_size, kv_heads / tp, head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvconnect.connector.events import KVEventsWorkerMetadata
from kvconnect.events import ExternalBlockHash
from kvconnect.messages import KVConnectorMetadata, KVConnectorWorkerMetadata

TIER_KINDS = ("cpu", "disk", "redis")
GROUP_IDX, SPEC_KIND = 0, "full_attention"
"""What the connector's events say of the KV cache group: a model with one kind of attention."""


@dataclass(frozen=True)
class TierConfig:
    kind: str
    """"cpu", "disk" or "redis"."""
    max_bytes: int = 1 << 30
    """Byte budget (cpu, disk); the least recently used chunks leave first."""
    path: str = ""
    """Directory of the disk tier."""
    url: str = ""
    """Redis URL: redis://[:password@]host:port/db, or rediss:// for TLS."""
    ttl_s: float | None = None
    """Redis: entries expire this many seconds after they are written (None: never)."""
    watch: bool = True
    """Redis: follow the server's keyspace notifications, so that what Redis evicts or
    expires is announced (BlockRemoved, medium EXTERNAL); see tiers/redis_watch.py."""
    cluster: bool = False
    """Redis: `url` is any node of a Redis Cluster (or Valkey cluster)."""


@dataclass(frozen=True)
class OffloadConfig:
    block_size: int
    """The engine's KV block size, in tokens."""
    chunk_size: int = 256
    """Tokens per stored chunk; a multiple of the engine's block size."""
    tiers: tuple[TierConfig, ...] = ()
    """Lookup order. Stores go to the first local tier (cpu, disk), whose evictions demote to
    the next local tier, and to every redis tier (shared, write-through)."""
    max_pending_stores: int = 64
    """Chunks waiting for the I/O thread; a store that finds the queue full is dropped and
    counted, so a step never waits for storage."""
    max_pending_steps: int = 64
    """Steps an event may wait for the other ranks before it is dropped (see EventQuorum)."""

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any], block_size: int) -> OffloadConfig:
        known = {"chunk_size", "tiers", "max_pending_stores", "max_pending_steps"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"OffloadConnector: unknown kv_connector_extra_config key(s) {unknown}; valid: "
                f"{', '.join(sorted(known))}"
            )
        chunk = extra.get("chunk_size", 256)
        if not isinstance(chunk, int) or chunk < block_size or chunk % block_size:
            raise ValueError(
                f"OffloadConnector: chunk_size={chunk!r} must be a multiple of the block size "
                f"{block_size}"
            )
        tiers = []
        for i, raw in enumerate(extra.get("tiers", [])):
            if not isinstance(raw, dict) or raw.get("kind") not in TIER_KINDS:
                raise ValueError(
                    f"OffloadConnector: tiers[{i}]={raw!r}: needs kind in {', '.join(TIER_KINDS)}"
                )
            valid = {"kind", "max_bytes", "path", "url", "ttl_s", "watch", "cluster"}
            if set(raw) - valid:
                raise ValueError(
                    f"OffloadConnector: tiers[{i}] keys {sorted(set(raw) - valid)}"
                    f" unknown; valid: {', '.join(sorted(valid))}"
                )
            tier = TierConfig(**raw)
            if tier.kind == "disk" and not tier.path:
                raise ValueError(f"OffloadConnector: tiers[{i}] (disk) needs a path")
            if tier.kind == "redis" and not tier.url:
                raise ValueError(f"OffloadConnector: tiers[{i}] (redis) needs a url")
            if tier.max_bytes <= 0:
                raise ValueError(f"OffloadConnector: tiers[{i}] max_bytes must be > 0")
            if tier.kind != "redis" and ({"ttl_s", "watch", "cluster"} & set(raw)):
                raise ValueError(
                    f"OffloadConnector: tiers[{i}]: ttl_s, watch and cluster are redis options"
                )
            if tier.ttl_s is not None and (
                not isinstance(tier.ttl_s, int | float)
                or isinstance(tier.ttl_s, bool)
                or tier.ttl_s <= 0
            ):
                raise ValueError(f"OffloadConnector: tiers[{i}] ttl_s={tier.ttl_s!r} must be > 0")
            for flag in ("watch", "cluster"):
                if not isinstance(getattr(tier, flag), bool):
                    raise ValueError(f"OffloadConnector: tiers[{i}] {flag} must be true or false")
            tiers.append(tier)
        if not tiers:
            raise ValueError("OffloadConnector: kv_connector_extra_config['tiers'] is empty")
        return cls(
            block_size,
            chunk,
            tuple(tiers),
            extra.get("max_pending_stores", 64),
            extra.get("max_pending_steps", 64),
        )


def chunk_key(model: str, world_size: int, rank: int, last_block_hash: bytes) -> str:
    """`model/world/rank/{hex}`. The braces are a Redis Cluster hash tag: every rank's key of
    one chunk lands in one hash slot, so one EXISTS checks them all (braces in the model name
    would move the tag, so they are replaced)."""
    name = model.replace("{", "(").replace("}", ")")
    return f"{name}/{world_size}/{rank}/{{{last_block_hash.hex()}}}"


@dataclass(frozen=True)
class ChunkInfo:
    """One chunk of one request: enough to store it, find it and describe it in events."""

    last_block_hash: bytes
    block_hashes: tuple[ExternalBlockHash, ...]
    """Wire hashes of the chunk's blocks (what the engine publishes for them)."""
    parent_block_hash: ExternalBlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    """Per block, the extra keys events carry (untagged); None when no block has any."""


@dataclass
class SaveSpec:
    chunk: ChunkInfo
    block_ids: list[int]
    """The engine blocks holding the chunk's tokens this step."""


@dataclass
class LoadSpec:
    request_id: str
    chunks: list[ChunkInfo]
    block_ids: list[list[int]]
    """Per chunk, the engine blocks to fill."""
    first_block: list[int]
    """Per chunk, how many of its leading blocks are already computed (not overwritten)."""


@dataclass
class OffloadMetadata(KVConnectorMetadata):
    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    reset: bool = False
    shared_gone: list[bytes] = field(default_factory=list)
    """Last block hashes of chunks a shared tier no longer holds (Redis evicted or expired
    them): workers forget they wrote them, so the next save writes them again."""


@dataclass
class OffloadWorkerMetadata(KVEventsWorkerMetadata):
    """Worker -> scheduler: the step's tier events per rank, and each rank's I/O jobs still
    queued or running (so the scheduler knows whether events are still to come)."""

    pending_io: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> OffloadWorkerMetadata:
        merged = super().aggregate(other)
        assert isinstance(merged, OffloadWorkerMetadata)
        merged.pending_io = {**self.pending_io, **getattr(other, "pending_io", {})}
        return merged
