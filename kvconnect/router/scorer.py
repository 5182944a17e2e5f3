"""Choosing an instance for a request: cached prefix against load, in prefill tokens.

    cost(i) = (prompt_tokens - weighted_hit_tokens(i)) + load_weight * in_flight(i)

`weighted_hit_tokens(i)` is the longest run of consecutive prefix blocks instance i can serve
(at its own block size), each block's tokens weighted by its best tier (GPU 1.0, CPU 0.8,
DISK 0.5, EXTERNAL 0.3 by default): roughly the prefill it saves. `load_weight` is how many
tokens of prefill one request already in flight is worth (default 64). The lowest cost wins;
ties go to the less loaded instance, then to the one chosen least often so far (cold traffic
spreads), then to the earlier one in the list. With nothing cached anywhere this is
least-loaded routing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

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
    num_chosen: Mapping[str, int] | None = None,
) -> Decision:
    """The cheapest of `candidates` (non-empty) for a request of `num_tokens` prompt tokens."""
    if not candidates:
        raise ValueError("no instance to route to")
    best: tuple[float, int, int, int] | None = None
    decision: Decision | None = None
    for order, name in enumerate(candidates):
        score = scores.get(name) or PrefixScore()
        load = loads.get(name, 0)
        cost = (num_tokens - score.weighted_tokens) + load_weight * load
        key = (round(cost, 9), load, (num_chosen or {}).get(name, 0), order)
        if best is None or key < best:
            best, decision = key, Decision(name, cost, score)
    assert decision is not None
    return decision
