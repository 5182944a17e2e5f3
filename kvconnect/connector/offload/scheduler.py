"""Scheduler half of the offload connector: what can be loaded, what to save, the events.

What the instance's own tiers hold is learned from the events the workers report in their
metadata, after the quorum: a chunk counts as held once every rank announced it (BlockStored)
in some local tier and none took it back (BlockRemoved). A shared tier is asked directly, off
the step thread (`lookup.PrefixLookup`): the request waits a step for the answer. So is the
configured peer a request names in `kv_transfer_params` (`peers/sources.py`), for the chunks
that neither holds: the workers then pull those from it.

    get_num_new_matched_tokens   whole chunks from the start that are held, up to the last
                                 prompt token (which must be computed): an async load;
                                 None while a shared tier's answer is outstanding
    update_state_after_alloc     the load's target blocks -> a LoadSpec for the workers
    build_connector_meta         this step's loads, and the chunks whose tokens became
                                 computed in this step (saves)
    request_finished             what a request that ran to its end computed past its
                                 saved chunks (its answer's, and a tail of fewer blocks):
                                 saved in the next step, its blocks held till then; P/D: a
                                 `do_remote_decode` request leases its prompt's chunks and
                                 answers with what the decode instance needs
                                 (NixlConnector's keys, and `remote_chunk_hashes`)

P/D in NixlConnector's handshake (vLLM's toy proxy, llm-d's sidecar and kvconnect's router
drive it unchanged): the request to P has `do_remote_decode: true` and runs as any other; its
chunks are saved as they are computed. When it finishes, every worker leases them (peers/leases.py:
kept in the cpu tier for `kv_lease_duration`), and the answer's `kv_transfer_params` name P's
peer port. The request to D carries them: `do_remote_prefill` names the source, the load is
a peer pull like `remote_kv_source`'s (the same checks), and D's ranks release the lease
after pulling. Whatever is not pulled is computed.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvconnect.connector.base import (
    CacheHitSource,
    ConnectorRequest,
    KVConnectorContext,
    KVConnectorOutput,
    SchedulerOutput,
)
from kvconnect.connector.events import EventQuorum, KVEventsWorkerMetadata
from kvconnect.connector.offload.common import (
    ChunkInfo,
    LeaseSpec,
    LoadSpec,
    OffloadConfig,
    OffloadMetadata,
    OffloadWorkerMetadata,
    SaveSpec,
    TierConfig,
    chunk_key,
    key_namespace,
    removed_event,
)
from kvconnect.connector.offload.kinds import TierKind
from kvconnect.connector.offload.lookup import PrefixLookup
from kvconnect.connector.offload.peers.sources import PeerSources
from kvconnect.connector.offload.peers.transport import PeerKeys
from kvconnect.connector.offload.tiers import RemovalWatcher, TierPlacement, create_tier
from kvconnect.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    tier_of,
)
from kvconnect.hashing import request_extra_keys, to_event, to_wire
from kvconnect.transfer_params import LEASE_OWNER, Named, to_decode

logger = logging.getLogger(__name__)

MAX_UNCONFIRMED = 1 << 16
"""Saved chunks whose shared store is not yet confirmed, remembered for the watcher."""
FINISHED_WHOLE = frozenset({"FINISHED_STOPPED", "FINISHED_LENGTH", "FINISHED_LENGTH_CAPPED"})
"""Statuses (kvconnect's and vLLM's names) of a request that ran to its end: only such a
prefill leases its chunks."""


@dataclass
class _Tracked:
    """A running request whose prompt chunks are saved as they become computed."""

    token_ids: list[int]
    block_hashes: list[bytes]
    cache_salt: str | None = None
    next_chunk: int = 0


@dataclass
class _Plan:
    """A load `get_num_new_matched_tokens` found, for `update_state_after_alloc`."""

    start: int
    """Tokens the engine has computed already."""
    num: int
    """Whole chunks from the start: the first `from_source` from this instance's tiers, the
    rest pulled from `source`."""
    tail: int
    """Blocks of chunk `num` loaded from a local tier's tail (0: none)."""
    source: Named | None
    from_source: int
    local: int = 0
    """Chunks from the start held by this instance's local tiers (a shared tier's follow)."""
    sync: bool = False
    """Every chunk is in the cpu tier: loaded before the step's forward (LoadSpec.sync)."""


def warn_unsigned(tiers: tuple[TierConfig, ...]) -> None:
    """One WARNING per shared tier without `hmac_key_file`, from the scheduler half (one per
    engine, where the workers' tiers would say it once per rank): its header checksums stop
    accidents only, so whoever can write to the store can plant chunks that this instance
    loads as its own KV and that change its outputs (docs/security.md, "Signed chunks")."""
    for i, tier in enumerate(tiers):
        if tier.kind.shared and not tier.hmac_key_file:
            logger.warning(
                "tiers[%d] (%s) has no hmac_key_file: anyone who can write to the Redis can "
                "feed this instance KV that changes its outputs; set hmac_key_file",
                i,
                tier.kind.value,
            )


class OffloadScheduler:
    def __init__(
        self,
        context: KVConnectorContext,
        config: OffloadConfig,
        metadata_class: type[OffloadMetadata] = OffloadMetadata,
    ) -> None:
        """`metadata_class` is what `build_connector_meta` builds, with every field set: an
        engine that needs its own type for the step's metadata (vLLM) gives a subclass."""
        self.context = context
        self.config = config
        self.metadata_class = metadata_class
        self.namespace = key_namespace(
            context.model_name, context.model_fingerprint, context.block_size, config.chunk_size
        )
        self.quorum = EventQuorum(context.world_size, max_pending_steps=config.max_pending_steps)
        self.held: dict[int | bytes, set[str]] = {}  # chunk (last block's wire hash) -> tiers
        self._local_tiers = {t.kind.tier for t in config.tiers if not t.kind.shared}
        self.lookup: PrefixLookup | None = None
        self.watcher: RemovalWatcher | None = None
        shared = [t for t in config.tiers if t.kind.shared]
        self._shared_kind = shared[0].kind if shared else None
        warn_unsigned(config.tiers)
        if shared:
            placement = TierPlacement(context.world_size, rank=0, namespace=self.namespace)
            tier = create_tier(shared[0], placement)
            tier.check_reachable()  # before any worker starts: a wrong URL fails at once
            self.lookup = PrefixLookup(tier)
            self.watcher = tier.watch_removals(
                f"{self.namespace}/{context.world_size}/", context.world_size, self._rank_keys
            )
        self.peers: PeerSources | None = None
        if config.peer is not None:
            keys = PeerKeys.from_config(config)  # a wrong key file fails the start, named
            if keys.mac is None:
                logger.warning(
                    "peer: no hmac_key_file (nor a tier's, nor a CURVE certificate): anyone who "
                    "can reach this instance's peer port can read its chunks, and anything that "
                    "answers on a source's port can feed it KV that changes its outputs; set "
                    "peer.hmac_key_file, the same key on every instance"
                )
            self.peers = PeerSources(config.peer, context.world_size, self.namespace, keys)
        # Chunks saved while a watcher runs: wire last hash -> raw, until their shared store
        # is released (the watcher follows keys, which name the raw hash).
        self._raw_by_wire: OrderedDict[int | bytes, bytes] = OrderedDict()
        self._shared_gone: list[bytes] = []
        self._plans: dict[str, _Plan] = {}
        self._hit_runs: dict[str, list[tuple[str, int]]] = {}  # request -> its load's sources
        self._leases: list[LeaseSpec] = []
        self._finishing: list[SaveSpec] = []  # finished requests' last saves, next step
        self._finishing_ids: list[str] = []
        self._holding: set[str] = set()  # their ids, until the workers report them copied
        engine_id = getattr(context.kv_transfer_config, "engine_id", None)
        self.engine_id = engine_id or str(uuid.uuid4())
        self._loads: list[LoadSpec] = []
        self._tracked: dict[str, _Tracked] = {}
        self._ready: list[KVCacheEvent] = []
        self._reset = False
        self.pending_io: dict[int, int] = {}  # rank -> I/O jobs it last reported
        self.busy_s: dict[int, float] = {}  # rank -> its longest job's time, last reported
        # Work given to the workers and no output seen since; at start, the workers' tiers
        # announce what they already hold (a disk tier after a restart).
        self._unreported = True

    def _wire(self, block_hash: bytes) -> int | bytes:
        return to_wire(block_hash, as_int=self.context.int_block_hashes)

    def chunk_info(
        self,
        token_ids: Sequence[int],
        block_hashes: Sequence[bytes],
        i: int,
        cache_salt: str | None,
        num_blocks: int | None = None,
    ) -> ChunkInfo:
        """Chunk i of a request, described as its KV events will describe it: its first
        `num_blocks` blocks only for a tail (default: all of them)."""
        per, bs = self.config.blocks_per_chunk, self.context.block_size
        first, end = i * per, i * per + (per if num_blocks is None else num_blocks)
        hashes = block_hashes[first:end]
        wire = self._wire
        parent = wire(block_hashes[first - 1]) if i else None
        keys = tuple(
            to_event(request_extra_keys(b, cache_salt=cache_salt)) for b in range(first, end)
        )
        return ChunkInfo(
            hashes[-1],
            tuple(wire(h) for h in hashes),
            parent,
            tuple(token_ids[first * bs : end * bs]),
            bs,
            keys if any(k is not None for k in keys) else None,
        )

    # -- loads ---------------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        c, per = self.config.chunk_size, self.config.blocks_per_chunk
        # Whole blocks up to the last prompt token, as the engine's own prefix cache: the last
        # chunk may be loaded in part (a 4,096-token prompt at block 128, chunk 256 loads
        # 3,968 tokens, not 3,840), if the request names the whole chunk (its last block's
        # hash is the chunk's key).
        limit = self._max_hit(request)
        max_chunks = min(-(-limit // c), len(request.block_hashes) // per)
        if min(max_chunks * c, limit) <= num_computed_tokens:
            return 0, False
        last = [request.block_hashes[(i + 1) * per - 1] for i in range(max_chunks)]
        num = 0
        while num < max_chunks and self.held.get(self._wire(last[num])):
            num += 1
        local = num
        if num < max_chunks and self.lookup is not None:
            chunks = [self._rank_keys(h) for h in last[num:]]
            num_shared = self.lookup.ask(request.request_id, num, chunks)
            if num_shared is None:
                return None, False
            num += num_shared
        source, from_source = None, num
        if num < max_chunks and self.peers is not None:
            source = self.peers.source_of(request)
            end = max_chunks if source is None else self._agreed(request, source, last)
            if source is not None and num < end:
                chunks = [self._rank_keys(h) for h in last[num:end]]
                num_peer = self.peers.ask(request.request_id, num, chunks, source.addr)
                if num_peer is None:
                    return None, False
                num += num_peer
        tail = self._held_tail(request, num, limit) if num == from_source else 0
        num_tokens = min(num * c + tail * self.context.block_size, limit)
        if num_tokens <= num_computed_tokens:
            return 0, False
        plan = _Plan(num_computed_tokens, num, tail, source, from_source, local)
        plan.sync = self.config.sync_cpu_loads and self._in_cpu(request, plan)
        self._plans[request.request_id] = plan
        return num_tokens - num_computed_tokens, not plan.sync

    def _in_cpu(self, request: ConnectorRequest, plan: _Plan) -> bool:
        """Whether the cpu tier holds every chunk `plan` loads (none from a shared tier or
        a peer, none from disk)."""
        if plan.source is not None and plan.from_source < plan.num:
            return False
        per, c = self.config.blocks_per_chunk, self.config.chunk_size
        ends = [(i + 1) * per for i in range(plan.start // c, plan.num)]
        ends += [plan.num * per + plan.tail] if plan.tail else []
        return all(
            TierKind.CPU.tier in self.held.get(self._wire(request.block_hashes[e - 1]), ())
            for e in ends
        )

    def _held_tail(self, request: ConnectorRequest, num: int, limit: int) -> int:
        """How many blocks of chunk `num` a local tier holds as a tail (the blocks a finished
        request had computed past its last whole chunk, saved when it finished): the longest
        held, within `limit` tokens; 0 if none."""
        per, bs = self.config.blocks_per_chunk, self.context.block_size
        first = num * per
        for k in range(min(per - 1, limit // bs - first, len(request.block_hashes) - first), 0, -1):
            if self.held.get(self._wire(request.block_hashes[first + k - 1])):
                return k
        return 0

    def _agreed(self, request: ConnectorRequest, source: Named, last: list[bytes]) -> int:
        """How many of the request's first chunks the source may be asked for: all, unless a
        prefill instance listed its chunks (P/D), then those from the first that are this
        prompt's (another hash seed or salt there shares none: logged)."""
        if source.chunk_hashes is None:
            return len(last)
        num = 0
        while num < min(len(last), len(source.chunk_hashes)) and (
            last[num] == source.chunk_hashes[num]
        ):
            num += 1
        if num == 0 and last and source.chunk_hashes:
            logger.warning(
                "offload: request %s: the prefill instance %s:%d leased other chunks than this "
                "prompt's (do both run the same model, PYTHONHASHSEED and cache_salt?): "
                "computing it",
                request.request_id,
                *source.addr,
            )
        return num

    def _max_hit(self, request: ConnectorRequest) -> int:
        """The most tokens a hit may cover: whole blocks, the last prompt token excluded."""
        bs = self.context.block_size
        return (len(request.all_token_ids) - 1) // bs * bs

    def _rank_keys(self, last_block_hash: bytes) -> list[str]:
        """The keys of one chunk on every rank (a shared tier must hold all of them)."""
        world = self.context.world_size
        return [chunk_key(self.namespace, world, r, last_block_hash) for r in range(world)]

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> bool:
        """Plan the load into `block_ids`; whether it is async (the request then waits)."""
        plan = self._plans.pop(request.request_id, None)
        self._forget(request.request_id)
        if plan is None or num_external_tokens == 0:
            return False
        start, num = plan.start, plan.num
        c, bs, per = self.config.chunk_size, self.context.block_size, self.config.blocks_per_chunk
        # The last chunk's blocks past the hit are not allocated to the load: fewer block ids.
        block_ids = block_ids[: min(num * c + plan.tail * bs, self._max_hit(request)) // bs]
        self._hit_runs[request.request_id] = self._sources_of(request, plan, num_external_tokens)
        spec = LoadSpec(request.request_id, [], [], [], sync=plan.sync)
        if plan.source is not None and plan.from_source < num:
            spec.source, spec.from_source = plan.source.addr, max(0, plan.from_source - start // c)
            spec.lease = plan.source.lease
        tokens, hashes = request.all_token_ids, request.block_hashes
        for i in range(start // c, num + (plan.tail > 0)):
            size = plan.tail if i == num else None
            spec.chunks.append(self.chunk_info(tokens, hashes, i, request.cache_salt, size))
            spec.block_ids.append(list(block_ids[i * per : (i + 1) * per]))
            spec.first_block.append(max(0, start - i * c) // bs)
        self._loads.append(spec)
        return not spec.sync

    def _sources_of(
        self, request: ConnectorRequest, plan: _Plan, num_tokens: int
    ) -> list[tuple[str, int]]:
        """The load's tokens, from its start, as runs of (the `CacheHitSource` value of the
        tier each chunk comes from, tokens): the workers look in the cpu tier first, then
        disk; then a shared tier's chunks; then a peer's."""
        c, per = self.config.chunk_size, self.config.blocks_per_chunk
        start, end = plan.start, plan.start + num_tokens
        runs: list[tuple[str, int]] = []
        for i in range(start // c, plan.num + (plan.tail > 0)):
            if i >= plan.num:  # the tail: blocks of chunk `num` in a local tier
                source = self._local_source(request.block_hashes[i * per + plan.tail - 1])
            elif i < plan.local:
                source = self._local_source(request.block_hashes[(i + 1) * per - 1])
            elif i < plan.from_source:
                source = CacheHitSource.EXTERNAL_UNSPECIFIED.value
            else:
                source = CacheHitSource.P2P.value
            n = min((i + 1) * c, end) - max(i * c, start)
            if n <= 0:
                continue
            if runs and runs[-1][0] == source:
                runs[-1] = (source, runs[-1][1] + n)
            else:
                runs.append((source, n))
        return runs

    def _local_source(self, last_block_hash: bytes) -> str:
        tiers = self.held.get(self._wire(last_block_hash), set())
        return (
            CacheHitSource.HOST.value if TierKind.CPU.tier in tiers else CacheHitSource.DISK.value
        )

    def hit_sources(self, request_id: str, num_tokens: int) -> dict[str, int]:
        """The first `num_tokens` of the request's load by source (what vLLM's
        `get_external_cache_hit_sources` and serve's usage show); tokens past what was
        planned are `external_unspecified`."""
        found: dict[str, int] = {}
        left = num_tokens
        for source, n in self._hit_runs.get(request_id, ()):
            take = min(n, left)
            if take > 0:
                found[source] = found.get(source, 0) + take
            left -= take
        if left > 0:
            unspecified = CacheHitSource.EXTERNAL_UNSPECIFIED.value
            found[unspecified] = found.get(unspecified, 0) + left
        return found

    # -- saves and the step ---------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadMetadata:
        meta = self.metadata_class(
            saves=self._finishing,
            loads=self._loads,
            reset=self._reset,
            shared_gone=self._shared_gone,
            idle=not scheduler_output.scheduled,
            leases=self._leases,
            finished_saves=self._finishing_ids,
        )
        self._loads, self._reset, self._shared_gone, self._leases = [], False, [], []
        self._finishing, self._finishing_ids = [], []
        self._unreported = self._unreported or bool(meta.loads or meta.reset or meta.leases)
        for new in scheduler_output.scheduled_new_reqs:
            self._tracked[new.request_id] = _Tracked(
                list(new.all_token_ids), list(new.block_hashes), new.cache_salt
            )
        c, per = self.config.chunk_size, self.config.blocks_per_chunk
        for s in scheduler_output.scheduled:
            tracked = self._tracked.get(s.request_id)
            if tracked is None:
                continue
            computed = s.start_position + len(s.token_ids)
            limit = min(computed, len(tracked.block_hashes) * self.context.block_size)
            while (tracked.next_chunk + 1) * c <= limit:
                i = tracked.next_chunk
                info = self.chunk_info(
                    tracked.token_ids, tracked.block_hashes, i, tracked.cache_salt
                )
                meta.saves.append(self._save(info, s.block_ids[i * per : (i + 1) * per]))
                tracked.next_chunk += 1
        self._unreported = self._unreported or bool(meta.saves)
        return meta

    def _save(self, info: ChunkInfo, block_ids: list[int]) -> SaveSpec:
        if self.watcher is not None:
            self._raw_by_wire[info.block_hashes[-1]] = info.last_block_hash
            if len(self._raw_by_wire) > MAX_UNCONFIRMED:
                self._raw_by_wire.popitem(last=False)
        return SaveSpec(info, list(block_ids))

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._holding -= output.finished_sending or set()
        meta = output.kv_connector_worker_meta
        if meta is not None and not isinstance(meta, KVEventsWorkerMetadata):
            raise TypeError(f"OffloadConnector got {type(meta).__name__} worker metadata")
        self.quorum.update(meta)
        self._unreported = False
        if isinstance(meta, OffloadWorkerMetadata):
            self.pending_io.update(meta.pending_io)
            self.busy_s.update(meta.busy_s)
        for event in self.quorum.take_events():
            self._track(event)
            self._ready.append(event)

    def _track(self, event: KVCacheEvent) -> None:
        if (
            self.watcher is not None
            and isinstance(event, BlockStored)
            and self._shared_kind is not None
            and tier_of(event.medium, event.locality) == self._shared_kind.tier
        ):
            raw = self._raw_by_wire.pop(event.block_hashes[-1], None)
            if raw is not None:
                self.watcher.announce(raw, event.block_hashes)
        if isinstance(event, AllBlocksCleared):
            self.held.clear()
        elif isinstance(event, BlockStored | BlockRemoved):
            tier = tier_of(event.medium, event.locality)
            if tier not in self._local_tiers:
                return
            chunk = event.block_hashes[-1]
            tiers = self.held.setdefault(chunk, set())
            if isinstance(event, BlockStored):
                tiers.add(tier)
            else:
                tiers.discard(tier)
                if not tiers:
                    del self.held[chunk]

    def has_pending_work(self) -> bool:
        """Whether events are still to come for work already under way (workers' I/O, or
        removals the watcher noticed): the engine should keep stepping, even idle."""
        return (
            self._reset  # the workers must be told, even on an idle engine
            or bool(self._leases)
            or bool(self._holding)  # finished requests' last saves, their blocks held
            or self._unreported
            or any(self.pending_io.values())
            or self.quorum.num_pending > 0
            or (self.watcher is not None and self.watcher.has_removed)
        )

    def health(self) -> str | None:
        """A rank whose I/O or pull job has run past `stuck_after_s` (its requests wait), as
        its workers last reported it; None when none has."""
        stuck = {r: s for r, s in self.busy_s.items() if s >= self.config.stuck_after_s}
        if not stuck or not any(self.pending_io.values()):
            return None
        rank, seconds = max(stuck.items(), key=lambda kv: kv[1])
        return (
            f"offload: rank {rank}'s I/O has run one job for {seconds:.0f} s (a tier or peer "
            "not answering); requests loading through it wait"
        )

    def take_events(self) -> list[KVCacheEvent]:
        ready, self._ready = self._ready, []
        if self.watcher is not None and self._shared_kind is not None:
            kind = self._shared_kind
            for last, hashes in self.watcher.take_removed():
                ready.append(removed_event(hashes, kind))
                self._shared_gone.append(last)
        return ready

    def _forget(self, request_id: str) -> None:
        if self.lookup is not None:
            self.lookup.forget(request_id)
        if self.peers is not None:
            self.peers.forget(request_id)

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Whether the request's blocks must wait (its last saves), and the answer's
        `kv_transfer_params`: for a prefill of P/D (`do_remote_decode`), what the decode
        instance needs, its chunks leased to it; else None."""
        tracked = self._tracked.pop(request.request_id, None)
        self._plans.pop(request.request_id, None)
        self._hit_runs.pop(request.request_id, None)
        self._forget(request.request_id)
        status = getattr(getattr(request, "status", None), "name", None)
        if tracked is None or status not in FINISHED_WHOLE:
            return False, None
        hold = self._save_rest(request, tracked, block_ids)
        return hold, self._pd_params(request, tracked)

    def _save_rest(
        self, request: ConnectorRequest, tracked: _Tracked, block_ids: list[int]
    ) -> bool:
        """A request that ran to its end: its blocks computed past the chunks saved so far
        (its answer's, and a tail of fewer blocks than a chunk) are saved in the next step,
        so that a returning turn of a chat recomputes at most its new tokens and the block
        they start in. Whether there are any: the blocks are then held until the workers
        report them copied (`finished_sending`)."""
        per = self.config.blocks_per_chunk
        tokens, hashes = request.all_token_ids, request.block_hashes
        # the last token was sampled, not computed: its KV is not in the cache
        num_blocks = min((len(tokens) - 1) // self.context.block_size, len(hashes), len(block_ids))
        saves = []
        if not self._local_tiers:  # a tail is kept in local tiers only: none to save
            num_blocks -= num_blocks % per
        for i in range(tracked.next_chunk, -(-num_blocks // per)):
            size = min(per, num_blocks - i * per)
            info = self.chunk_info(tokens, hashes, i, tracked.cache_salt, size)
            if not self.held.get(info.block_hashes[-1]):  # a chat's earlier turn saved it
                saves.append(self._save(info, block_ids[i * per : i * per + size]))
        if not saves:
            return False
        self._finishing.extend(saves)
        self._finishing_ids.append(request.request_id)
        self._holding.add(request.request_id)
        return True

    def _pd_params(self, request: ConnectorRequest, tracked: _Tracked) -> dict[str, Any] | None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode"):
            return None
        if self.config.peer is None or not self.config.peer.pd:
            return None  # another connector's handshake, or none: not ours to answer
        if not tracked.next_chunk:
            return None
        peer, per = self.config.peer, self.config.blocks_per_chunk
        last = [tracked.block_hashes[(i + 1) * per - 1] for i in range(tracked.next_chunk)]
        expires_at = time.time() + peer.kv_lease_duration
        owner = params.get(LEASE_OWNER)
        owner = owner if isinstance(owner, str) else None
        self._leases.append(LeaseSpec(request.request_id, last, expires_at, owner))
        return to_decode(
            peer=(peer.reachable_host, peer.port),
            lease=request.request_id,
            engine_id=self.engine_id,
            tp_size=self.context.world_size,
            num_tokens=tracked.next_chunk * self.config.chunk_size,
            expires_at=expires_at,
            chunk_hashes=[h.hex() for h in last],
        )

    def reset_cache(self) -> bool:
        """The local tiers are emptied by the workers at the next step: from now on nothing
        is planned from them (a load planned now would meet an emptied tier)."""
        self._reset = True
        self.held.clear()
        return True

    def shutdown(self) -> None:
        if self.peers is not None:
            self.peers.shutdown()
        if self.watcher is not None:
            self.watcher.shutdown()
        if self.lookup is not None:
            self.lookup.shutdown()
            self.lookup.tier.close()
