"""Choosing an instance for a request: cached prefix against load, in prefill tokens.

    cost(i) = (prompt_tokens - weighted_hit_tokens(i)) + load_weight * in_flight(i)

`weighted_hit_tokens(i)` is the longest run of consecutive prefix blocks instance i can serve
(at its own block size), each block's tokens weighted by its best tier (GPU 1.0, CPU 0.8,
STORAGE/LOCAL 0.5, STORAGE/REMOTE 0.3 by default): roughly the prefill it saves. `load_weight`
is how many tokens of prefill one request already in flight is worth (default 64). The lowest
cost wins; ties go to the less loaded instance, then to the one holding fewer blocks (cold
tenants spread over the instances' caches), then by rendezvous hashing of the request's
`spread_key` (its first tokens) with each instance's name. Nothing in the choice depends on
a replica's own history, so router replicas that follow the same streams decide alike. With
nothing cached anywhere this is least-loaded routing.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import xxhash

from kvconnect.router.index import PrefixScore

DEFAULT_LOAD_WEIGHT = 64.0


@dataclass(frozen=True)
class Decision:
    instance: str
    cost: float
    score: PrefixScore


def choose(
    candidates: Sequence[str],
    scores: Mapping[str, PrefixScore],
    loads: Mapping[str, int],
    num_tokens: int,
    load_weight: float = DEFAULT_LOAD_WEIGHT,
    spread_key: int = 0,
    num_blocks: Mapping[str, int] | None = None,
) -> Decision:
    """The cheapest of `candidates` (non-empty) for a request of `num_tokens` prompt tokens."""
    if not candidates:
        raise ValueError("no instance to route to")
    best: tuple[float, int, int, int, int] | None = None
    sizes = num_blocks or {}
    decision: Decision | None = None
    for order, name in enumerate(candidates):
        score = scores.get(name) or PrefixScore()
        load = loads.get(name, 0)
        cost = (num_tokens - score.weighted_tokens) + load_weight * load
        spread = -xxhash.xxh3_64_intdigest(name.encode(), seed=spread_key & (2**64 - 1))
        key = (round(cost, 9), load, sizes.get(name, 0), spread, order)
        if best is None or key < best:
            best, decision = key, Decision(name, cost, score)
    assert decision is not None
    return decision


def spread_key(token_ids: Sequence[int]) -> int:
    """The request's tie-break key, from its first 64 tokens: requests that start alike go
    to one place when neither cache nor load decides (where their prefix will then be)."""
    head = token_ids[:64]
    try:
        data = array("I", head).tobytes()  # 4 bytes a token: a copy in C, no text
    except (OverflowError, TypeError):  # not what a tokenizer makes; still a key
        data = repr(list(head)).encode()
    return xxhash.xxh3_64_intdigest(data)
