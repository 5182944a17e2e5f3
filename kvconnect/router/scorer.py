"""Choosing an instance for a request: cached prefix against load, in prefill tokens. The
cost formula is stated here, once (docs/architecture.md and costs.py point here):

    local(i)   = (prompt - hit_w(i)) + L(i)
    pull(i, j) = (prompt - held(j)) + (held(i) - hit_w(i)) + P(j, i, held(j) - held(i)) + L(i)
    cost(i)    = min(local(i), pull(i, j) for each source j) * s_i

    hit_w(i)   the longest run of consecutive prefix blocks i can serve (at its own block
               size), each block's tokens weighted by its best tier (GPU 1.0, CPU 0.8,
               STORAGE/LOCAL 0.5, STORAGE/REMOTE 0.3 by default): roughly the prefill it saves
    held(i)    the same run's tokens, unweighted
    L(i)       load_weight * in_flight(i) (load_weight: the tokens of prefill one request in
               flight is worth, default 64); with pulls on, pending(i) + Q(i): pending(i) the
               prompt tokens i has still to compute for the requests in flight there (the
               router's own count, as Dynamo's router counts active prefill tokens), Q(i)
               the queue's measured cost q_i / b_i * in_flight(i) (load_weight *
               in_flight(i) until measured; `costs.CostModel.load_tokens`)
    P(j, i, n) what pulling n tokens from j costs i, in prompt tokens it computes meanwhile:
               (f_ji + c_ji * n) / b_i (`costs.CostModel.pull_tokens`)
    s_i        b_i over the median b of the candidates (`costs.CostModel.time_scale`, 1/4..4;
               1 until two fits stand): the candidates compare by time

Without sources (instances with a peer tier, `remote_kv_source`), or with `--no-pulls`, cost(i)
is local(i) with L(i) = load_weight * in_flight(i) and s_i = 1: the choice depends on nothing
but the index and the loads, so router replicas that follow the same streams decide alike;
with them, on each replica's fits too (costs.py), which agree once both have seen answers.

The lowest cost wins (at equal cost, no pull); ties go to the less loaded instance, then to
the one holding fewer blocks (cold tenants spread over the instances' caches), then by
rendezvous hashing of the request's `spread_key` (its first tokens) with each instance's
name. With nothing cached anywhere this is least-loaded routing.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import xxhash

from kvconnect.router.index import PrefixScore

DEFAULT_LOAD_WEIGHT = 64.0


@dataclass(frozen=True)
class Decision:
    instance: str
    """The instance chosen."""
    cost: float
    """Its cost (the formula above), in prompt tokens' worth."""
    score: PrefixScore
    """What the index credits it with."""
    source: str | None = None
    """An instance to pull the prefix from (`remote_kv_source`): it holds more of it."""
    computed: int = 0
    """The prompt tokens the instance is expected to compute (what it lacks, or what
    neither it nor the source holds)."""


PullTokens = Callable[[str, str, int], float]
"""(source, instance, tokens): what pulling `tokens` from source costs instance, in prompt
tokens it would compute meanwhile (`costs.CostModel.pull_tokens`)."""


@dataclass(frozen=True)
class Inputs:
    """What `choose` weighs for one request: the index's scores, the loads, the learned
    costs. Without `pull_tokens` (no sources), the choice depends on the first four alone."""

    scores: Mapping[str, PrefixScore]
    """Per instance, what it holds of the prompt (absent: nothing)."""
    loads: Mapping[str, int]
    """Per instance, the requests in flight there."""
    num_tokens: int
    """The prompt's tokens."""
    load_weight: float = DEFAULT_LOAD_WEIGHT
    spread_key: int = 0
    """The request's tie-break key (`spread_key`)."""
    num_blocks: Mapping[str, int] | None = None
    """Per instance, the blocks the index holds of it: at equal cost and load, the emptier
    instance wins (cold tenants spread over the caches)."""
    sources: Sequence[str] = ()
    """Instances that serve pulls (a peer tier)."""
    pull_tokens: PullTokens | None = None
    load_tokens: Callable[[str, int], float] | None = None
    """(instance, in flight): the measured cost of its queue, in prompt tokens; replaces
    load_weight * in_flight, and `pending` is added to it."""
    pending: Mapping[str, int] | None = None
    """Per instance, the prompt tokens it has still to compute for the requests in flight."""
    time_scale: Mapping[str, float] | None = None
    """Per instance, what its prompt token takes against a typical instance's (1 absent)."""


_EMPTY = PrefixScore()


def choose(
    candidates: Sequence[str], inputs: Inputs, costs_out: dict[str, float] | None = None
) -> Decision:
    """The cheapest of `candidates` (non-empty) for a request of `num_tokens` prompt tokens.
    With `sources` and `pull_tokens`, each candidate may also pull the prefix a source holds
    beyond its own (`_pulls`); at equal cost, no pull. `load_tokens(i, in_flight(i))`, where
    given, replaces load_weight * in_flight(i), and `pending(i)` is added: i's prefill
    serves those tokens before this one's. `time_scale` multiplies each candidate's costs
    (`costs.CostModel.time_scale`): a slower instance's tokens count for more.
    `costs_out`, where given, gets each candidate's own best cost (to compare two routers'
    choices)."""
    if not candidates:
        raise ValueError("no instance to route to")
    x = inputs
    sizes, pending, scales = x.num_blocks or {}, x.pending or {}, x.time_scale or {}
    best: tuple[float, int, int, int, int, int] | None = None
    decision: Decision | None = None
    for order, name in enumerate(candidates):
        score = x.scores.get(name) or _EMPTY
        load = x.loads.get(name, 0)
        if x.load_tokens is None:
            on_load = x.load_weight * load
        else:
            on_load = x.load_tokens(name, load) + pending.get(name, 0)
        spread = -xxhash.xxh3_64_intdigest(name.encode(), seed=x.spread_key & (2**64 - 1))
        tie = (load, sizes.get(name, 0), spread, order)
        scale = scales.get(name, 1.0)
        cost = ((x.num_tokens - score.weighted_tokens) + on_load) * scale
        key = (round(cost, 9), 0, *tie)
        if best is None or key < best:
            best, decision = key, Decision(name, cost, score, None, x.num_tokens - score.num_tokens)
        if costs_out is not None:
            costs_out[name] = cost
        if x.pull_tokens is None:  # no sources: nothing to pull (no generator per candidate)
            continue
        for source, held, cost in _pulls(x, x.pull_tokens, name, score, on_load, scale):
            key = (round(cost, 9), 1, *tie)
            if key < best:
                best, decision = key, Decision(name, cost, score, source, x.num_tokens - held)
            if costs_out is not None and cost < costs_out[name]:
                costs_out[name] = cost
    assert decision is not None
    return decision


def _pulls(
    x: Inputs, pull_tokens: PullTokens, name: str, score: PrefixScore, on_load: float, scale: float
) -> Iterator[tuple[str, int, float]]:
    """(source, its held tokens, cost) of each pull `name` could make: from every source
    holding more of the prefix than `name` does, pull(i, j) (the module's formula): the
    prompt past j's prefix computed, i's own hit as usual, the difference pulled."""
    own = score.num_tokens
    for source in x.sources:
        held = (x.scores.get(source) or _EMPTY).num_tokens
        if source == name or held <= own:
            continue
        pulled = pull_tokens(source, name, held - own)
        cost = ((x.num_tokens - held) + (own - score.weighted_tokens) + pulled + on_load) * scale
        yield source, held, cost


def spread_key(token_ids: Sequence[int]) -> int:
    """The request's tie-break key, from its first 64 tokens: requests that start alike go
    to one place when neither cache nor load decides (where their prefix will then be)."""
    head = token_ids[:64]
    try:
        data = array("I", head).tobytes()  # 4 bytes a token: a copy in C, no text
    except (OverflowError, TypeError):  # not what a tokenizer makes; still a key
        data = repr(list(head)).encode()
    return xxhash.xxh3_64_intdigest(data)
