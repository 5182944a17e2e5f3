"""How an instance's engine hashes its blocks, learned from its own KV events.

A router can only match a request to an instance's blocks if it computes the same hashes. So
it learns each instance's scheme from the stream: a `BlockStored` that starts a prefix (no
parent) and carries its tokens is checked against the configured scheme, then against every
known (algorithm, seed) candidate, at the event's own block size:

    event: block_hashes [h0, ...], parent None, token_ids t[0:B*n], block_size B
    scheme S matches  <=>  to_wire(S.hash((NONE_HASH_S, t[0:B], extra_0))) == h0

vLLM at its defaults (sha256, seed "vllm-none-hash") and with PYTHONHASHSEED=0 are among the
candidates. An engine whose seed no router can know (vLLM's xxhash without PYTHONHASHSEED, a
private seed, an unknown algorithm) matches none: that instance is then keyed by a chain the
router computes itself over the events' token ids (`RouterKeys`), so its prefixes still route.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvconnect.events import BlockStored, ExternalBlockHash
from kvconnect.hashing import (
    ALGORITHMS,
    VLLM_DEFAULT_SEED,
    ExtraKeys,
    block_hashes,
    from_event,
    get_hash_fn,
    request_extra_keys,
    resolve_seed,
    seed_hash,
    to_wire,
)


@dataclass(frozen=True)
class HashScheme:
    """An algorithm and the seed string of its NONE_HASH."""

    algorithm: str
    seed: str

    @classmethod
    def resolve(cls, algorithm: str, seed: str | None = None) -> HashScheme:
        """`seed=None`: vLLM's rule, in this process's environment."""
        return cls(algorithm, resolve_seed(algorithm, seed))

    def __str__(self) -> str:
        return f"{self.algorithm}:{self.seed}"

    def wire_hashes(
        self,
        token_ids: Sequence[int],
        block_size: int,
        extra_keys: Sequence[ExtraKeys | None] | None = None,
        parent_hash: bytes | None = None,
        cache_salt: str | None = None,
        as_int: bool = True,
    ) -> list[ExternalBlockHash]:
        """The event-form hashes of the full blocks of `token_ids` under this scheme."""
        raw = block_hashes(
            token_ids,
            block_size,
            algorithm=self.algorithm,
            seed=self.seed,
            extra_keys=extra_keys,
            parent_hash=parent_hash,
            cache_salt=cache_salt,
        )
        return [to_wire(h, as_int=as_int) for h in raw]

    def iter_wire_hashes(
        self,
        token_ids: Sequence[int],
        block_size: int,
        memo: ChainMemo,
        cache_salt: str | None = None,
    ) -> Iterator[int]:
        """The int wire hashes of the request's full blocks, one at a time, from `memo` where
        it holds the block's whole prefix, computed (and remembered) otherwise. A consumer
        that stops early (scoring, at the first block no instance holds) hashes no further."""
        table, segments = memo.table, memo.segments
        hash_fn = get_hash_fn(self.algorithm)
        bs = block_size
        num_blocks = len(token_ids) // bs
        # The memo key of block i chains Python's tuple hash over everything that decides the
        # block's hash: the scheme, the block size, the salt, the tokens of blocks 0..i. A run
        # of SEGMENT_BLOCKS blocks from a multiple of it is also remembered whole, keyed by the
        # key before it and its tokens: a long seen prefix costs one lookup per segment.
        key = hash((self.algorithm, self.seed, bs, cache_salt))
        first_extra = request_extra_keys(0, cache_salt=cache_salt)  # later blocks: None
        parent: bytes | None = None
        seg = SEGMENT_BLOCKS
        i = 0
        while i < num_blocks:
            seg_key = None
            if i % seg == 0 and i + seg <= num_blocks:
                seg_key = hash((key, tuple(token_ids[i * bs : (i + seg) * bs])))
                whole = segments.get(seg_key)
                if whole is not None:
                    parent, wires, key = whole
                    memo.num_hits += seg
                    yield from wires
                    i += seg
                    continue
            # Block by block, through this segment (remembered whole at its end).
            end = min(num_blocks, (i // seg + 1) * seg)
            done: list[int] = []
            for j in range(i, end):
                block = tuple(token_ids[j * bs : (j + 1) * bs])
                key = hash((key, block))
                hit = table.get(key)
                if hit is not None:
                    parent = hit[0]
                    memo.num_hits += 1
                    wire = hit[1]
                else:
                    if parent is None:
                        parent = seed_hash(self.algorithm, self.seed)
                    parent = hash_fn((parent, block, first_extra if j == 0 else None))
                    wire = to_wire(parent)
                    memo.num_misses += 1
                    memo.put(key, parent, wire)
                done.append(wire)
                yield wire
            if seg_key is not None and len(done) == seg and parent is not None:
                memo.put_segment(seg_key, parent, tuple(done), key)
            i = end


SEGMENT_BLOCKS = 64


class ChainMemo:
    """A bounded memo of request block hashes, keyed by a chained 64-bit digest of their
    whole prefix (see `HashScheme.iter_wire_hashes`): a prompt that extends one seen before
    costs a tuple hash per block where it is shared, and the real hash only where it is new.
    Oldest entries go first past `max_blocks` (about 250 bytes each). The key is not a
    cryptographic hash: a collision (about 2^-64 per lookup by chance; craftable on purpose)
    gives that request wrong hashes, which can only misroute it, never change an output (the
    engine computes its own hashes)."""

    def __init__(self, max_blocks: int = 200_000) -> None:
        if max_blocks < 0:
            raise ValueError(f"max_blocks must be >= 0, got {max_blocks}")
        self.max_blocks = max_blocks
        self.table: dict[int, tuple[bytes, int]] = {}
        self.segments: dict[int, tuple[bytes, tuple[int, ...], int]] = {}
        """Whole runs of SEGMENT_BLOCKS blocks: (last raw hash, their wire hashes, the block
        key after them)."""
        self.num_hits = 0
        self.num_misses = 0

    def put(self, key: int, raw: bytes, wire: int) -> None:
        table = self.table
        if self.max_blocks == 0:
            return
        if len(table) >= self.max_blocks and key not in table:
            del table[next(iter(table))]  # the oldest insertion
        table[key] = (raw, wire)

    def put_segment(self, key: int, raw: bytes, wires: tuple[int, ...], end_key: int) -> None:
        segments = self.segments
        limit = self.max_blocks // SEGMENT_BLOCKS
        if limit == 0:
            return
        if len(segments) >= limit and key not in segments:
            del segments[next(iter(segments))]
        segments[key] = (raw, wires, end_key)

    def __len__(self) -> int:
        return len(self.table)


def candidate_schemes(configured: HashScheme) -> list[HashScheme]:
    """The configured scheme first, then every algorithm with the seeds engines are known to
    use: vLLM's default, PYTHONHASHSEED=0, this process's PYTHONHASHSEED, the configured one."""
    seeds = [VLLM_DEFAULT_SEED, "0", os.environ.get("PYTHONHASHSEED"), configured.seed]
    out = [configured]
    for algorithm in ALGORITHMS:
        for seed in seeds:
            scheme = HashScheme(algorithm, seed) if seed is not None else None
            if scheme is not None and scheme not in out:
                out.append(scheme)
    return out


def checkable(event: BlockStored) -> list[ExtraKeys | None] | None:
    """The tagged extra keys of a prefix-starting event whose first block a router can hash
    itself; None if the event cannot be checked (a parent, no tokens, a LoRA block...)."""
    n = len(event.block_hashes)
    if event.parent_block_hash is not None or n == 0 or event.block_size < 1:
        return None
    if len(event.token_ids) != event.block_size * n:
        return None
    if event.extra_keys is not None and len(event.extra_keys) != n:
        return None
    try:
        return [
            from_event(event.extra_keys[i] if event.extra_keys else None, i, event.lora_name)
            for i in range(n)
        ]
    except ValueError:
        return None


def first_block_matches(
    event: BlockStored, extra_keys: list[ExtraKeys | None], scheme: HashScheme
) -> bool:
    bs = event.block_size
    first = event.block_hashes[0]
    mine = scheme.wire_hashes(
        event.token_ids[:bs], bs, extra_keys[:1], as_int=isinstance(first, int)
    )
    return mine[0] == first


def learn(event: BlockStored, candidates: Sequence[HashScheme]) -> HashScheme | bool | None:
    """The first candidate that reproduces the event's first block; None if none does;
    False if the event cannot be checked."""
    keys = checkable(event)
    if keys is None:
        return False
    return next((s for s in candidates if first_block_matches(event, keys, s)), None)


class RouterKeys:
    """For an instance whose hashes the router cannot reproduce: engine hash -> the router's
    own digest of the same block, counted like index entries (one per announcement), so later
    removals and parent links resolve. The index keys the block by the digest's wire form,
    which is what the router computes for a request. Bounded: past `max_entries` the oldest
    mapping goes."""

    def __init__(self, scheme: HashScheme, max_entries: int) -> None:
        self.scheme = scheme
        self.max_entries = max_entries
        self._digests: OrderedDict[ExternalBlockHash, list[Any]] = OrderedDict()  # [digest, n]
        self.num_unresolvable = 0

    def __len__(self) -> int:
        return len(self._digests)

    def store(self, event: BlockStored) -> list[ExternalBlockHash]:
        """The router keys of the event's blocks (also recorded); [] if it cannot be keyed."""
        n, bs = len(event.block_hashes), event.block_size
        if event.token_ids and bs >= 1 and len(event.token_ids) == n * bs:
            digests = self._chain(event)
        else:  # no tokens (e.g. an offload tier's event): blocks already known only
            found = [self._digests.get(h) for h in event.block_hashes]
            digests = None if any(f is None for f in found) else [f[0] for f in found]  # type: ignore[index]
        if digests is None:
            self.num_unresolvable += 1
            return []
        for h, digest in zip(event.block_hashes, digests, strict=True):
            entry = self._digests.get(h)
            if entry is None:
                self._digests[h] = [digest, 1]
                if len(self._digests) > self.max_entries:
                    self._digests.popitem(last=False)
            else:
                entry[1] += 1
        return [to_wire(d) for d in digests]

    def _chain(self, event: BlockStored) -> list[bytes] | None:
        parent: bytes | None = None
        if event.parent_block_hash is not None:
            known = self._digests.get(event.parent_block_hash)
            if known is None:  # its prefix was never seen (or forgotten): cannot chain
                return None
            parent = known[0]
        keys = event.extra_keys
        if keys is not None and len(keys) != len(event.block_hashes):
            return None
        offset = 0 if parent is None else 1  # a salt may only sit on a request's block 0
        try:
            extra = [from_event(k, i + offset, event.lora_name) for i, k in enumerate(keys or ())]
        except ValueError:
            return None
        return block_hashes(
            event.token_ids,
            event.block_size,
            algorithm=self.scheme.algorithm,
            seed=self.scheme.seed,
            extra_keys=extra or None,
            parent_hash=parent,
        )

    def remove(self, h: ExternalBlockHash) -> ExternalBlockHash | None:
        """The router key of a removed block (one announcement less); None if unknown."""
        entry = self._digests.get(h)
        if entry is None:
            self.num_unresolvable += 1
            return None
        entry[1] -= 1
        if entry[1] == 0:
            del self._digests[h]
        return to_wire(entry[0])

    def clear(self) -> None:
        self._digests.clear()

    def check_integrity(self) -> None:
        assert len(self._digests) <= self.max_entries, "over the mapping cap"
        assert all(n > 0 for _, n in self._digests.values()), "a mapping with no announcement"
