"""KV cache events and their wire codec: the one schema kvconnect speaks, which is vLLM's.

The fields are vLLM 0.33's, in its order, so a batch decoded and encoded again is the same
bytes (msgspec writes a map16 header for BlockStored's 16 possible keys, a fixmap for
BlockRemoved's 6). Wire form of one batch (msgpack), as vLLM >= 0.26 sends it:

    [ts, [event, ...], data_parallel_rank]            the batch: a positional array
    {"type": "BlockStored", "block_hashes": [...], ...}   each event: a map, "type" first,
                                                          fields in declaration order,
                                                          fields equal to their default omitted

`encode_batch(batch, legacy=True)` writes the older form, where each event is a positional
array `["BlockStored", block_hashes, parent_block_hash, ...]` with trailing defaults omitted.

`decode_batch` reads what routers meet in the field: either event shape (mixed, even), a batch
of 2 or 3 elements (or more), unknown keys, int or bytes hashes. Anything it cannot read raises
`EventDecodeError`, and only that.

`ownership` (vLLM PR #52067, in 0.33 on BlockStored at 12 and BlockRemoved at 4): which
secondary offloading tier generated the event; None is the engine's own (its block pool and its
connector's tiers). kvconnect's connectors leave it None, by choice: in vLLM 0.33 only a
secondary tier beside the offloading connector sets it (KVCR: "kvcr"), its own CPU and storage
tiers do not; and Dynamo reads a set ownership as another residency domain whose events bypass
its per-worker refcounts, on the promise of one residency per (owner, tier, hash). kvconnect's
tiers are the engine's and may announce one block twice (a tail and the whole chunk, counted by
holders), so marking them would make such a reader drop a block on its first removal. Readers
here keep ownership as vLLM does: the publisher's state counts each ownership apart
(`stream/state.py`); the router counts holders per tier, which a domain that balances its own
removals leaves right.

Field order matters for the legacy form; never insert a field, only append.
This module imports nothing from the rest of the package.
"""

from __future__ import annotations

from typing import Any

import msgspec

ExternalBlockHash = int | bytes

MEDIUM_GPU = "GPU"
"""The engine's own paged KV cache."""
MEDIUM_CPU = "CPU"
"""Host memory of the instance."""
MEDIUM_STORAGE = "STORAGE"
"""Storage beyond memory: a local disk (`LOCAL`) or a store several instances share (`REMOTE`)."""
MEDIUMS = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE)
"""vLLM 0.33's mediums, all that kvconnect publishes."""
LOCALITY_LOCAL = "LOCAL"
"""The tier is the publisher's own (its disk)."""
LOCALITY_REMOTE = "REMOTE"
"""The tier is reached over the network, and may be shared (a Redis)."""
MEDIUM_DISK = "DISK"
"""Before vLLM 0.33 (and kvconnect before it): a local disk; read as STORAGE/LOCAL."""
MEDIUM_EXTERNAL = "EXTERNAL"
"""Before vLLM 0.33 (and kvconnect before it): a shared store; read as STORAGE/REMOTE."""

TIER_GPU = MEDIUM_GPU
TIER_CPU = MEDIUM_CPU
TIER_STORAGE_LOCAL = f"{MEDIUM_STORAGE}/{LOCALITY_LOCAL}"
TIER_STORAGE_REMOTE = f"{MEDIUM_STORAGE}/{LOCALITY_REMOTE}"
_LEGACY_TIERS = {MEDIUM_DISK: TIER_STORAGE_LOCAL, MEDIUM_EXTERNAL: TIER_STORAGE_REMOTE}
_TIERS: dict[tuple[str | None, str | None], str] = {}


def tier_of(medium: str | None, locality: str | None = None) -> str:
    """The tier an event speaks of, as one label: its medium, `/LOCALITY` where it has one
    ("STORAGE/REMOTE"); an unset medium is the engine's GPU cache, the older DISK and EXTERNAL
    are STORAGE/LOCAL and STORAGE/REMOTE. Readers key by this, so old and new streams meet."""
    key = (medium, locality)
    tier = _TIERS.get(key)
    if tier is None:
        if medium is None or medium == MEDIUM_GPU:
            tier = TIER_GPU if locality is None else f"{MEDIUM_GPU}/{locality}"
        elif medium in _LEGACY_TIERS and locality is None:
            tier = _LEGACY_TIERS[medium]
        else:
            tier = medium if locality is None else f"{medium}/{locality}"
        if len(_TIERS) < 1024:  # a stream of made-up mediums cannot grow it without bound
            _TIERS[key] = tier
    return tier


class EventDecodeError(ValueError):
    """A payload is not a KV event batch kvconnect can read; the message says why."""


def _freeze(value: Any) -> Any:
    """A hashable twin of decoded data: lists become tuples, maps sorted item tuples."""
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value


class KVCacheEvent(msgspec.Struct, tag=True, tag_field="type", omit_defaults=True, gc=False):
    """Base of the event types. Events compare by value and are hashable, so they can be
    counted and deduplicated (the quorum across workers relies on it)."""

    def __hash__(self) -> int:
        return hash((type(self).__name__, _freeze(msgspec.structs.astuple(self))))


class BlockStored(KVCacheEvent):
    """Blocks became available in `medium`: `block_hashes` in chain order, the first one's
    parent is `parent_block_hash` (None for a prefix start), `token_ids` are the tokens of
    those blocks, `block_size` tokens each."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    """One entry per block: its extra keys, untagged (see `hashing.to_event`)."""
    group_idx: int | None = None
    """The KV cache group (0 for a model with one kind of attention layer)."""
    kv_cache_spec_kind: str | None = None
    """The group's kind, e.g. "full_attention", "sliding_window", "mamba"."""
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    """"LOCAL" or "REMOTE" relative to the publisher; None: unspecified (vLLM 0.26+)."""
    ownership: str | None = None
    """A secondary offloading tier's identifier, if one generated the event (None: the
    engine's own, what kvconnect's connectors publish; see the module docstring)."""
    session_id: str | None = None
    """The session whose request stored or reused the blocks."""
    lookahead_token_ids: list[list[int]] | None = None
    """Speculative tokens beyond the stored blocks, per block (vLLM 0.33)."""


class BlockRemoved(KVCacheEvent):
    """Blocks are gone from `medium`."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None
    """As BlockStored's: whose residency is removed (None: the engine's own)."""


class AllBlocksCleared(KVCacheEvent):
    """Every block of the instance's cache was dropped (a prefix-cache reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The events of one engine step. `ts` is `time.time()`; the publisher fills
    `data_parallel_rank` when it is None."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


# Legacy twins for decoding: the same fields, read from positional arrays with the tag first.
class _LegacyBlockStored(BlockStored, tag="BlockStored", array_like=True):
    pass


class _LegacyBlockRemoved(BlockRemoved, tag="BlockRemoved", array_like=True):
    pass


class _LegacyAllBlocksCleared(AllBlocksCleared, tag="AllBlocksCleared", array_like=True):
    pass


_LegacyEvent = _LegacyBlockStored | _LegacyBlockRemoved | _LegacyAllBlocksCleared


class _LegacyBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_LegacyEvent]
    data_parallel_rank: int | None = None


_EVENT_TYPES: dict[str, type[KVCacheEvent]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}
_FROM_LEGACY: dict[type[KVCacheEvent], type[KVCacheEvent]] = {
    _LegacyBlockStored: BlockStored,
    _LegacyBlockRemoved: BlockRemoved,
    _LegacyAllBlocksCleared: AllBlocksCleared,
}

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_legacy_decoder = msgspec.msgpack.Decoder(_LegacyBatch)
_any_decoder = msgspec.msgpack.Decoder()


def encode_batch(batch: KVEventBatch, legacy: bool = False) -> bytes:
    """msgpack bytes of `batch`: map-form events, or positional arrays when `legacy`.

    As vLLM's (msgspec writes every element of an array-like struct), a batch whose
    `data_parallel_rank` is None still has three elements, the last one nil.
    """
    if legacy:
        events = [_legacy_event(e) for e in batch.events]
        return _encoder.encode([batch.ts, events, batch.data_parallel_rank])
    return _encoder.encode(batch)


def _legacy_event(event: KVCacheEvent) -> list[Any]:
    """`[tag, field0, field1, ...]` with trailing fields equal to their defaults dropped."""
    cls = type(event)
    values = msgspec.structs.astuple(event)
    defaults = cls.__struct_defaults__
    num_required = len(values) - len(defaults)
    n = len(values)
    while n > num_required and values[n - 1] == defaults[n - 1 - num_required]:
        n -= 1
    return [cls.__name__, *values[:n]]


def decode_batch(data: bytes | bytearray | memoryview) -> KVEventBatch:
    """Read a batch in any form vLLM-compatible producers send; `EventDecodeError` otherwise."""
    try:
        return _decoder.decode(data)
    except msgspec.MsgspecError:
        pass
    try:
        legacy = _legacy_decoder.decode(data)
    except msgspec.MsgspecError:
        return _decode_loose(data)
    events = [_FROM_LEGACY[type(e)](*msgspec.structs.astuple(e)) for e in legacy.events]
    return KVEventBatch(legacy.ts, events, legacy.data_parallel_rank)  # type: ignore[arg-type]


def _decode_loose(data: bytes | bytearray | memoryview) -> KVEventBatch:
    """The slow path for shapes the typed decoders reject (mixed event forms, a map batch)."""
    try:
        raw = _any_decoder.decode(data)
    except msgspec.MsgspecError as e:
        raise EventDecodeError(f"not msgpack: {e}") from None
    try:
        return _batch_from_raw(raw)
    except EventDecodeError:
        raise
    except (msgspec.MsgspecError, TypeError, ValueError, KeyError, IndexError) as e:
        raise EventDecodeError(f"bad batch: {e}") from None


def _batch_from_raw(raw: Any) -> KVEventBatch:
    if isinstance(raw, dict):
        raw = [raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")]
    if not isinstance(raw, list) or len(raw) < 2:
        raise EventDecodeError("a batch must be an array [ts, events, data_parallel_rank]")
    ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise EventDecodeError(f"batch ts must be a number, got {type(ts).__name__}")
    if not isinstance(events, list):
        raise EventDecodeError(f"batch events must be an array, got {type(events).__name__}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise EventDecodeError(f"data_parallel_rank must be an int, got {type(rank).__name__}")
    return KVEventBatch(float(ts), [_event_from_raw(e) for e in events], rank)


def _event_from_raw(raw: Any) -> KVEvent:
    if isinstance(raw, dict):
        tag = raw.get("type")
    elif isinstance(raw, list) and raw:
        tag = raw[0]
    else:
        raise EventDecodeError(f"an event must be a map or an array, got {type(raw).__name__}")
    cls = _EVENT_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise EventDecodeError(f"unknown event type {tag!r}; known: {', '.join(_EVENT_TYPES)}")
    names = cls.__struct_fields__
    if isinstance(raw, dict):
        known = {k: v for k, v in raw.items() if k in names}
    else:  # positional: extra trailing fields from newer producers are dropped
        known = dict(zip(names, raw[1:], strict=False))
    known["type"] = tag
    # builtin_types: bytes stay bytes; a str is not silently read as base64.
    event: KVEvent = msgspec.convert(known, cls, builtin_types=(bytes,))  # type: ignore[assignment]
    return event


__all__ = [
    "LOCALITY_LOCAL",
    "LOCALITY_REMOTE",
    "MEDIUMS",
    "MEDIUM_CPU",
    "MEDIUM_DISK",
    "MEDIUM_EXTERNAL",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "TIER_CPU",
    "TIER_GPU",
    "TIER_STORAGE_LOCAL",
    "TIER_STORAGE_REMOTE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventDecodeError",
    "ExternalBlockHash",
    "KVCacheEvent",
    "KVEvent",
    "KVEventBatch",
    "decode_batch",
    "encode_batch",
]
