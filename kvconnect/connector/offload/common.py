"""What both halves of the offload connector share: settings, chunk identity, step messages.

A chunk is `chunk_size` consecutive tokens of a request, a multiple of the engine's block size,
starting at a multiple of `chunk_size` (a request that ends stores a *tail* too: the first
blocks of a chunk it did not fill, a chunk of fewer blocks). It is stored once per TP rank
(each rank holds its own KV heads) under a key naming the model, the world size, the rank and
the chained hash of the chunk's last block, so the same prefix finds the same entries across
requests and instances:

    tokens  [ chunk 0: blocks 0..15 | chunk 1: blocks 16..31 | ...]     chunk_size 256, block 16
    key     "<model>@<fp>/<world_size>/<rank>/<hex hash of block 15>"    (then block 31, ...)

`<fp>` is the model fingerprint (`key_namespace`): the engine's identity of the weights and
their config, dtype, block and chunk size, so another checkpoint (or precision, or chunking)
served under the same model name never meets these entries. A key is only where to look: the
worker checks that what it finds there describes the chunk asked for (worker.py).

Chunk data on a rank: [num_layers, planes, chunk_size, heads / tp, dim], planes 2 (K, V) or 1
(an MLA latent, a packed cache): the same bytes whatever the engine's layout (layout.py).

Settings are msgspec structs: each field declares its type and bounds, so msgspec checks them
(no coercion: "256" is not a chunk size, true is not a byte count); `__post_init__` checks the
rules that join fields. Every error is a `ValueError` naming the field.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec

from kvconnect.config import KVTransferConfig
from kvconnect.connector.events import KVEventsWorkerMetadata
from kvconnect.connector.offload.kinds import KIND_NAMES, TierKind
from kvconnect.events import BlockRemoved, BlockStored, ExternalBlockHash
from kvconnect.messages import KVConnectorMetadata, KVConnectorWorkerMetadata
from kvconnect.transfer_params import parse_endpoint

GROUP_IDX, SPEC_KIND = 0, "full_attention"
"""What the connector's events say of the KV cache group: a model with one kind of attention."""

Positive = Annotated[int, msgspec.Meta(ge=1)]
Seconds = Annotated[float, msgspec.Meta(gt=0)]
REDIS_OPTIONS = frozenset({"ttl_s", "watch", "cluster", "backoff_s", "max_backoff_s"})


class TierConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One entry of `kv_connector_extra_config["tiers"]`."""

    kind: TierKind
    """cpu, disk or redis (see kinds.py)."""
    max_bytes: Positive = 1 << 30
    """Byte budget (cpu, disk); the least recently used chunks leave first."""
    path: str = ""
    """Directory of the disk tier."""
    url: str = ""
    """Redis URL: redis://[:password@]host:port/db, or rediss:// for TLS."""
    ttl_s: Seconds | None = None
    """Redis: entries expire this many seconds after they are written (None: never)."""
    watch: bool = True
    """Redis: follow the server's keyspace notifications, so that what Redis evicts or
    expires is announced (BlockRemoved, STORAGE/REMOTE); see tiers/redis_watch.py."""
    cluster: bool = False
    """Redis: `url` is any node of a Redis Cluster (or Valkey cluster)."""
    backoff_s: Seconds = 0.5
    """Redis: once the server has not answered (a timeout, a refused or lost connection), the
    tier sends nothing for this long: its loads miss and its stores drop at once, instead of
    each waiting out the socket timeout. Then one operation probes; each probe that fails
    doubles the wait, one that succeeds ends it (tiers/backoff.py)."""
    max_backoff_s: Seconds = 30.0
    """Redis: the longest wait between probes (at least `backoff_s`): how long a server that
    came back may go unused."""
    password_file: str = ""
    """Redis: a file holding the password (its owner's alone: mode 0600, else refused at
    start; see config.check_secret_mode), used with the URL's user if it names one; keeps
    the password out of command lines and config JSON."""
    hmac_key_file: str = ""
    """Disk, redis: a file holding a deployment secret (at least 16 bytes, mode 0600, checked
    at start); chunks are then HMAC-signed and an unsigned or wrongly signed entry is a miss.
    Every instance sharing the tier must name the same key. A redis tier without one is a
    WARNING at start (`scheduler.warn_unsigned`)."""

    def __post_init__(self) -> None:
        # `==`, not `is`: a TierConfig built in code may name its kind by the plain string.
        if self.kind == TierKind.DISK and not self.path:
            raise ValueError("the disk tier needs a path")
        if self.kind == TierKind.REDIS and not self.url:
            raise ValueError("the redis tier needs a url")
        if self.password_file and self.kind != TierKind.REDIS:
            raise ValueError("password_file is for the redis tier")
        credentials = self.url.partition("://")[2].partition("/")[0].rpartition("@")[0]
        if self.password_file and ":" in credentials:
            raise ValueError("the redis tier has a password in its url and a password_file")
        for name in ("backoff_s", "max_backoff_s"):  # msgspec checks only what it decodes
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        if self.max_backoff_s < self.backoff_s:
            raise ValueError(
                f"max_backoff_s={self.max_backoff_s!r} must be at least backoff_s="
                f"{self.backoff_s!r}"
            )
        if self.kind == TierKind.CPU and self.hmac_key_file:
            raise ValueError(
                "hmac_key_file is for the disk and redis tiers (the cpu tier is this "
                "process's own memory: nothing outside it writes there)"
            )


Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Host = Annotated[str, msgspec.Meta(min_length=1, max_length=253)]
MAX_PEER_SOURCES = 64
MibPerSecond = Annotated[float, msgspec.Meta(gt=0)]
Share = Annotated[float, msgspec.Meta(gt=0, le=1)]


class PeerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`kv_connector_extra_config["peer"]`: this instance serves the chunks of its local tiers
    to other instances and pulls from the configured peer a request names into its own blocks
    (peers/), in either form of `kv_transfer_params`: `remote_kv_source` {host, port},
    or a decode request's `do_remote_prefill` with the prefill instance's `remote_host` and
    `remote_port` (NixlConnector's handshake; a `do_remote_decode` request leases its chunks
    and answers with those, peers/leases.py)."""

    port: Port
    """TP rank r serves on port + r (a request names a source by its rank 0's port)."""
    host: Host = "127.0.0.1"
    """Where this instance's ranks serve: loopback by default."""
    sources: Annotated[tuple[Host, ...], msgspec.Meta(max_length=MAX_PEER_SOURCES)] = ()
    """The peers this instance may pull from, each `HOST:PORT` (its host and rank 0's peer
    port, `[v6 address]:PORT`), exactly as requests name them: a request that names any other
    is refused (serve: a 400 naming the key; under vLLM: logged, the prompt computed), so a
    client cannot make this instance connect where it likes. None by default: list every
    instance this one may pull from, a P/D decode instance its prefill instances."""
    timeout_s: Seconds = 5.0
    """A source silent for this long fails the lookup or the pull: its chunks are recomputed.
    A pull's whole deadline is this plus its bytes at `min_rate_mib_s`."""
    min_rate_mib_s: MibPerSecond = 64.0
    """The slowest a pull may move its chunks (MiB/s, beyond `timeout_s`): a slower source
    fails it, so a peer that trickles bytes holds a request (and a pull thread) for a bounded
    time only. Pulls run at 1-2 GB/s on a loopback."""
    max_connections: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 128
    """Connections one rank's server holds at once; a new one past it closes the longest idle
    one (one that has not proved the hmac key first), or is closed itself."""
    hmac_key_file: str = ""
    """A file holding a secret every peer shares (mode 0600, at least 16 bytes): connections
    prove it in their handshake, served chunks are signed with it and pulled ones must be.
    Without it, a tier's `hmac_key_file` signs peer traffic too (the same deployment
    secret), else a key derived from `curve_secret_key_file`; with none, a WARNING at start."""
    curve_secret_key_file: str = ""
    """A ZMQ certificate with its secret key (mode 0600) every peer shares: the peer sockets
    then run CurveZMQ (encrypted; a peer that cannot prove that secret key completes no
    handshake)."""
    kv_lease_duration: Seconds = 30.0
    """P/D: how long a `do_remote_decode` request's chunks stay leased (not evicted from the
    cpu tier) for the decode instance that is to pull them, unless it releases them first
    (vLLM's NixlConnector has the same key and default)."""
    max_leased_share: Share = 0.5
    """P/D: the share of the cpu tier's slots that leases may hold at once. A request that
    would lease past it runs without a lease (counted `num_leases_refused`): its decode
    instance pulls what is still there and computes the rest; the other half of the tier
    keeps serving everyone's prefixes."""
    max_leased_share_per_client: Share = 0.5
    """The same, for the leases of one client (the API key its requests came with, at
    `kvconnect serve` with several `--api-key`s; under vLLM, whose server does not tell the
    connector, every request is one client's)."""
    pd: bool = True
    """P/D: answer and follow NixlConnector's handshake with kvconnect's own transfer. Set
    false beside another P/D connector (NixlConnector) in a MultiConnector: that one answers
    it (vLLM refuses two connectors that answer the same keys), and kvconnect then takes
    only `remote_kv_source`."""
    advertise_host: Host | None = None
    """P/D: the host a `do_remote_decode` answer tells the decode instance to pull from
    (default: `host`; needed when `host` is a wildcard such as 0.0.0.0)."""

    def __post_init__(self) -> None:
        if self.advertise_host is None and self.host in ("0.0.0.0", "::", "*", "[::]"):
            raise ValueError(
                f"peer.host={self.host!r} listens everywhere: set peer.advertise_host to the "
                "address other instances reach this one at"
            )
        for i, source in enumerate(self.sources):
            parse_endpoint(source, f"peer.sources[{i}]")

    @property
    def reachable_host(self) -> str:
        return self.advertise_host or self.host

    @property
    def source_addrs(self) -> frozenset[tuple[str, int]]:
        """`sources` as (host, port) pairs, as a request names them."""
        return frozenset(parse_endpoint(s, "peer.sources") for s in self.sources)


class OffloadConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The connector's `kv_connector_extra_config`, with the engine's block size."""

    block_size: Positive
    """The engine's KV block size, in tokens."""
    chunk_size: Positive = 256
    """Tokens per stored chunk; a multiple of the engine's block size."""
    tiers: tuple[TierConfig, ...] = ()
    """Lookup order. Stores go to the first local tier (cpu, disk), whose evictions demote to
    the next local tier, and to every redis tier (shared, write-through)."""
    max_pending_stores: Positive = 64
    """Chunks waiting for the I/O thread; a store that finds the queue full is dropped and
    counted, so a step never waits for storage."""
    max_pending_steps: Positive = 64
    """Steps an event may wait for the other ranks before it is dropped (see EventQuorum)."""
    stuck_after_s: Seconds = 30.0
    """A worker's I/O or pull job running this long (a tier or peer that stopped answering)
    makes the connector report itself stuck: `kvconnect serve`'s /health answers 503 with
    the reason until the job ends."""
    peer: PeerConfig | None = None
    """Serve local chunks to peers and pull from them per request (None: neither)."""
    sync_cpu_loads: bool = True
    """A load wholly from the cpu tier (host memory copies, a few ms) runs inside the step
    that schedules its request, before the forward that computes the prompt's rest, as
    LMCache loads by default. Otherwise (and always for disk, redis and peers) the load is
    async: the request waits out of the batch (vLLM's WAITING_FOR_REMOTE_KVS) and runs a
    step or two later, each step as long as the batch's forward."""

    def __post_init__(self) -> None:
        if self.chunk_size < self.block_size or self.chunk_size % self.block_size:
            raise ValueError(
                f"chunk_size={self.chunk_size!r} must be a multiple of the block size "
                f"{self.block_size}"
            )
        if not self.tiers:
            raise ValueError("kv_connector_extra_config['tiers'] is empty")

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any], block_size: int) -> OffloadConfig:
        """The settings in a `kv_connector_extra_config`, for an engine of `block_size`;
        `ValueError` naming the key or field that is wrong."""
        valid = [name for name in cls.__struct_fields__ if name != "block_size"]
        _check_keys("kv_connector_extra_config", extra, valid)
        tiers = extra.get("tiers", [])
        for i, raw in enumerate(tiers if isinstance(tiers, list) else []):
            _check_tier_keys(i, raw)
        try:
            return msgspec.convert({**extra, "block_size": block_size}, cls)
        except msgspec.ValidationError as e:
            # msgspec names the field by its path from the root: `$.tiers[0].max_bytes`.
            raise ValueError(f"OffloadConnector: {e}".replace("`$.", "`")) from None


def configured_peer(transfer: KVTransferConfig | None, block_size: int) -> PeerConfig | None:
    """The offload connector's peer settings in `transfer` (itself, or a MultiConnector's
    child), None without one; `ValueError` as `OffloadConfig.from_extra_config` raises it."""
    if transfer is None:
        return None
    configs = [transfer.kv_connector_extra_config]
    if transfer.kv_connector == "MultiConnector":
        children = transfer.kv_connector_extra_config.get("connectors") or []
        configs = [
            c.get("kv_connector_extra_config") or {}
            for c in children
            if isinstance(c, dict) and c.get("kv_connector") == "OffloadConnector"
        ]
    elif transfer.kv_connector != "OffloadConnector":
        return None
    for extra in configs:
        peer = OffloadConfig.from_extra_config(extra, block_size).peer
        if peer is not None:
            return peer
    return None


def _check_keys(where: str, given: Collection[str], valid: Collection[str]) -> None:
    """`ValueError` listing the valid keys if `given` holds another one (msgspec would name
    only the first unknown key, without the choices)."""
    unknown = sorted(set(given) - set(valid))
    if unknown:
        raise ValueError(
            f"OffloadConnector: unknown {where} key(s) {unknown}; valid: {', '.join(sorted(valid))}"
        )


def _check_tier_keys(i: int, raw: object) -> None:
    """What a tier's declared fields cannot say: the kinds to choose from, and that the redis
    options are for redis only (given at all, even at their defaults)."""
    if not isinstance(raw, dict) or raw.get("kind") not in KIND_NAMES:
        raise ValueError(
            f"OffloadConnector: tiers[{i}]={raw!r}: needs kind in {', '.join(KIND_NAMES)}"
        )
    _check_keys(f"tiers[{i}]", raw, TierConfig.__struct_fields__)
    if raw["kind"] != TierKind.REDIS and REDIS_OPTIONS & set(raw):
        raise ValueError(
            f"OffloadConnector: tiers[{i}]: {', '.join(sorted(REDIS_OPTIONS))} are redis options"
        )


def key_namespace(model_name: str, fingerprint: str, block_size: int, chunk_size: int) -> str:
    """`model@<16 hex>`: the model's name (readable in a key listing) and a digest of
    everything that makes its chunks' contents differ (`fingerprint` from the engine, see
    `KVConnectorContext.model_fingerprint`; the block and chunk size)."""
    what = f"{model_name}\0{fingerprint}\0{block_size}\0{chunk_size}".encode()
    return f"{model_name}@{hashlib.blake2b(what, digest_size=8).hexdigest()}"


def chunk_key(namespace: str, world_size: int, rank: int, last_block_hash: bytes) -> str:
    """`namespace/world/rank/{hex}` (`namespace` from `key_namespace`). The braces are a Redis
    Cluster hash tag: every rank's key of one chunk lands in one hash slot, so one EXISTS
    checks them all (braces in the model name would move the tag, so they are replaced)."""
    return f"{rank_prefix(namespace, world_size, rank)}{{{last_block_hash.hex()}}}"


def rank_prefix(namespace: str, world_size: int, rank: int) -> str:
    """What every `chunk_key` of one rank starts with."""
    name = namespace.replace("{", "(").replace("}", ")")
    return f"{name}/{world_size}/{rank}/"


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


def stored_event(info: ChunkInfo, kind: TierKind) -> BlockStored:
    """A chunk in a tier, described in full (tokens, parent, extra keys), as the engine's own
    events describe its blocks, so a router can check and use it on its own."""
    return BlockStored(
        list(info.block_hashes),
        info.parent_block_hash,
        list(info.token_ids),
        info.block_size,
        None,
        kind.medium,
        None,
        extra_keys=list(info.extra_keys or [None] * len(info.block_hashes)),
        group_idx=GROUP_IDX,
        kv_cache_spec_kind=SPEC_KIND,
        locality=kind.locality,
    )


def removed_event(block_hashes: Sequence[ExternalBlockHash], kind: TierKind) -> BlockRemoved:
    """A chunk gone from a tier (its blocks' wire hashes), as the connector announces it."""
    return BlockRemoved(
        list(block_hashes), kind.medium, group_idx=GROUP_IDX, locality=kind.locality
    )


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
    """Per chunk, the engine blocks to fill: the chunk's first blocks (all of them, but for a
    request's last chunk, which may be loaded in part)."""
    first_block: list[int]
    """Per chunk, how many of its leading blocks are already computed (not overwritten)."""
    source: tuple[str, int] | None = None
    """(host, rank 0's port) of the peer that holds `chunks[from_source:]` (the earlier ones
    come from this instance's tiers)."""
    from_source: int = 0
    lease: str | None = None
    """P/D: the lease at `source` to release once pulled (its `remote_request_id`)."""
    sync: bool = False
    """Every chunk is in the cpu tier: the load runs before this step's forward, which
    computes the request's rest (`OffloadConfig.sync_cpu_loads`); not reported finished."""


@dataclass
class LeaseSpec:
    """P/D: chunks every worker keeps for a decode instance (peers/leases.py)."""

    lease_id: str
    last_block_hashes: list[bytes]
    expires_at: float
    """Wall-clock time (`time.time()`), as the answer tells the decode instance."""
    owner: str | None = None
    """The client it is for (quotas count per client): `transfer_params.LEASE_OWNER`."""


@dataclass
class OffloadMetadata(KVConnectorMetadata):
    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    reset: bool = False
    shared_gone: list[bytes] = field(default_factory=list)
    """Last block hashes of chunks a shared tier no longer holds (Redis evicted or expired
    them): workers forget they wrote them, so the next save writes them again."""
    idle: bool = False
    """The engine computes nothing this step (it only waits, for loads among others): a
    worker with loads under way may wait a little for one, off the GIL (see the vLLM
    plugin's get_finished), instead of the engine spinning against its I/O thread."""
    leases: list[LeaseSpec] = field(default_factory=list)
    finished_saves: list[str] = field(default_factory=list)
    """Finished requests whose last chunks are among `saves`: once those are copied out,
    workers report them in `finished_sending`, and the engine frees their blocks."""


@dataclass
class OffloadWorkerMetadata(KVEventsWorkerMetadata):
    """Worker -> scheduler: the step's tier events per rank, and each rank's I/O jobs still
    queued or running (so the scheduler knows whether events are still to come)."""

    pending_io: dict[int, int] = field(default_factory=dict)
    busy_s: dict[int, float] = field(default_factory=dict)
    """Each rank's longest-running I/O or pull job, in seconds (0: none runs)."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> OffloadWorkerMetadata:
        merged = super().aggregate(other)
        assert isinstance(merged, OffloadWorkerMetadata)
        merged.pending_io = {**self.pending_io, **getattr(other, "pending_io", {})}
        merged.busy_s = {**self.busy_s, **getattr(other, "busy_s", {})}
        return merged
