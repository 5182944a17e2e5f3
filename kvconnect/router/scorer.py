"""Choosing an instance for a request: cached prefix against load, in prefill tokens.

    cost(i) = (prompt_tokens - weighted_hit_tokens(i)) + load_weight * in_flight(i)

`weighted_hit_tokens(i)` is the longest run of consecutive prefix blocks instance i can serve
(at its own block size), each block's tokens weighted by its best tier (GPU 1.0, CPU 0.8,
STORAGE/LOCAL 0.5, STORAGE/REMOTE 0.3 by default): roughly the prefill it saves. `load_weight`
is how many tokens of prefill one request already in flight is worth (default 64). The lowest
cost wins; ties go to the less loaded instance, then to the one holding fewer blocks (cold
tenants spread over the instances' caches), then by rendezvous hashing of the request's
`spread_key` (its first tokens) with each instance's name. With nothing cached anywhere this
is least-loaded routing.

Where instances serve each other's prefixes (the peer tier, `remote_kv_source`), a candidate
may also pull what another holds beyond its own prefix (`choose`'s `sources`); the pull's
cost is learned from answers (costs.py), and a candidate's load counts what it has still to
prefill for the requests in flight there (`pending`: the router's own count, as Dynamo's
router counts active prefill tokens) besides their measured cost per request, and each
candidate's cost is scaled by its measured prefill time per token against a typical
instance's (`time_scale`), so that the candidates compare by time. Without sources
the choice depends on nothing but
the index and the loads, so router replicas that follow the same streams decide alike; with
them, on each replica's fits too, which agree once both have seen answers.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import xxhash

from kvconnect.router.index import PrefixScore

DEFAULT_LOAD_WEIGHT = 64.0


@dataclass(frozen=True)
class Decision:
    instance: str
    cost: float
    score: PrefixScore
    source: str | None = None
    """An instance to pull the prefix from (`remote_kv_source`): it holds more of it."""
    computed: int = 0
    """The prompt tokens the instance is expected to compute (what it lacks, or what
    neither it nor the source holds)."""


PullTokens = Callable[[str, str, int], float]
"""(source, instance, tokens): what pulling `tokens` from source costs instance, in prompt
tokens it would compute meanwhile (`costs.CostModel.pull_tokens`)."""


def choose(
    candidates: Sequence[str],
    scores: Mapping[str, PrefixScore],
    loads: Mapping[str, int],
    num_tokens: int,
    load_weight: float = DEFAULT_LOAD_WEIGHT,
    spread_key: int = 0,
    num_blocks: Mapping[str, int] | None = None,
    sources: Sequence[str] = (),
    pull_tokens: PullTokens | None = None,
    load_tokens: Callable[[str, int], float] | None = None,
    costs_out: dict[str, float] | None = None,
    pending: Mapping[str, int] | None = None,
    time_scale: Mapping[str, float] | None = None,
) -> Decision:
    """The cheapest of `candidates` (non-empty) for a request of `num_tokens` prompt tokens.
    With `sources` (instances that serve pulls) and `pull_tokens`, each candidate may also
    pull the prefix a source holds beyond its own:

        cost(i, j) = (prompt_tokens - held(j)) + (held(i) - weighted_hit_tokens(i))
                     + pull_tokens(j, i, held(j) - held(i)) + load_weight * in_flight(i)

    the prompt past j's prefix computed, i's own hit as usual, the difference pulled. At
    equal cost, no pull. `load_tokens(i, in_flight(i))`, where given, replaces
    load_weight * in_flight(i) (the measured cost of a queue, costs.py); with it, `pending(i)`
    is added: the prompt tokens i has still to compute for the requests in flight there,
    which its prefill serves before this one's. `costs_out`, where given, gets each
    candidate's own best cost (to compare two routers' choices). `time_scale`, where given,
    multiplies each candidate's costs by what its prompt token takes against a typical
    instance's (`costs.CostModel.time_scale`; 1 where absent): a slower instance's tokens
    count for more."""
    if not candidates:
        raise ValueError("no instance to route to")
    best: tuple[float, int, int, int, int, int] | None = None
    sizes = num_blocks or {}
    decision: Decision | None = None
    empty = PrefixScore()
    for order, name in enumerate(candidates):
        score = scores.get(name) or empty
        load = loads.get(name, 0)
        if load_tokens is None:
            on_load = load_weight * load
        else:
            on_load = load_tokens(name, load) + (pending or {}).get(name, 0)
        spread = -xxhash.xxh3_64_intdigest(name.encode(), seed=spread_key & (2**64 - 1))
        tie = (load, sizes.get(name, 0), spread, order)
        scale = (time_scale or {}).get(name, 1.0)
        cost = ((num_tokens - score.weighted_tokens) + on_load) * scale
        key = (round(cost, 9), 0, *tie)
        if best is None or key < best:
            best, decision = key, Decision(name, cost, score, None, num_tokens - score.num_tokens)
        if costs_out is not None:
            costs_out[name] = cost
        if pull_tokens is None:
            continue
        own = score.num_tokens
        for source in sources:
            held = (scores.get(source) or empty).num_tokens
            if source == name or held <= own:
                continue
            cost = (
                (num_tokens - held)
                + (own - score.weighted_tokens)
                + pull_tokens(source, name, held - own)
                + on_load
            ) * scale
            key = (round(cost, 9), 1, *tie)
            if key < best:
                best, decision = key, Decision(name, cost, score, source, num_tokens - held)
            if costs_out is not None and cost < costs_out[name]:
                costs_out[name] = cost
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
