import random
from collections.abc import Callable

import pytest

from kvconnect.router.index import PrefixScore
from kvconnect.router.scorer import Inputs, choose, spread_key

A, B, C = "a", "b", "c"
BS = 16
PROMPT = 12 * BS  # 12 full blocks of 16 tokens


def s(blocks: int, weighted: float | None = None, block_size: int = BS) -> PrefixScore:
    w = float(blocks) if weighted is None else weighted
    return PrefixScore(blocks, w, block_size=block_size)


def test_longer_cached_prefix_wins_at_equal_load() -> None:
    d = choose([A, B], Inputs({A: s(2), B: s(10)}, {}, PROMPT))
    assert d.instance == B and d.cost == pytest.approx(2.0 * BS)


def test_tier_weights_make_a_shorter_gpu_prefix_beat_a_longer_disk_one() -> None:
    assert choose([A, B], Inputs({A: s(6), B: s(10, 10 * 0.5)}, {}, PROMPT)).instance == A


def test_load_outweighs_a_small_hit_but_not_a_large_one() -> None:
    assert (
        choose([A, B], Inputs({A: s(2)}, {A: 1}, PROMPT)).instance == B
    )  # 32 tokens < 64 per request
    assert choose([A, B], Inputs({A: s(10)}, {A: 1}, PROMPT)).instance == A


def test_cold_request_goes_to_the_least_loaded_and_ties_to_the_first() -> None:
    assert choose([A, B, C], Inputs({}, {A: 2, B: 0, C: 1}, PROMPT)).instance == B
    assert (
        choose([A, B], Inputs({A: s(4)}, {A: 1, B: 0}, PROMPT)).instance == B
    )  # equal cost: less load


def test_ties_spread_by_request_and_do_not_depend_on_order_or_history() -> None:
    """Rendezvous hashing of the request's key: cold requests spread evenly, one key always
    lands on one instance, whatever the candidates' order: replicas decide alike."""
    names = [f"http://i{i}:8000" for i in range(4)]
    picks = [choose(names, Inputs({}, {}, PROMPT, spread_key=k)).instance for k in range(400)]
    counts = {n: picks.count(n) for n in names}
    assert all(60 < c < 140 for c in counts.values()), counts
    for k in range(50):
        assert choose(names[::-1], Inputs({}, {}, PROMPT, spread_key=k)).instance == picks[k]
    # An instance that leaves only moves the keys that were on it.
    rest = [choose(names[1:], Inputs({}, {}, PROMPT, spread_key=k)).instance for k in range(400)]
    assert all(r == p for r, p in zip(rest, picks, strict=True) if p != names[0])
    assert spread_key(list(range(100))) == spread_key(list(range(64)) + [7] * 36)
    # Before the hash: the instance holding less (a cold tenant goes to the emptier cache).
    sizes = {n: 100 for n in names} | {names[2]: 3}
    assert all(
        choose(names, Inputs({}, {}, PROMPT, spread_key=k, num_blocks=sizes)).instance == names[2]
        for k in range(20)
    )


def test_shared_tier_score_counts_for_everyone() -> None:
    shared = s(10, 3.0)  # 10 EXTERNAL blocks at 0.3
    d = choose([A, B], Inputs({A: shared, B: s(4)}, {}, PROMPT))
    assert d.instance == B  # 4 GPU blocks beat 10 shared-store blocks


def test_instances_with_different_block_sizes_compare_in_tokens() -> None:
    # A holds 3 blocks of 32 tokens (96), B holds 5 blocks of 16 (80): A saves more prefill.
    assert choose([A, B], Inputs({A: s(3, block_size=32), B: s(5)}, {}, PROMPT)).instance == A
    assert choose([A, B], Inputs({A: s(2, block_size=32), B: s(5)}, {}, PROMPT)).instance == B


def test_no_candidates() -> None:
    with pytest.raises(ValueError, match="no instance"):
        choose([], Inputs({}, {}, 1))


def flat(ratio: float) -> Callable[[str, str, int], float]:
    """A pull that costs `ratio` computed tokens per pulled one, whoever the pair."""
    return lambda _source, _instance, n: ratio * n


def test_a_loaded_holder_lends_its_prefix_to_an_idle_instance() -> None:
    """A holds 10 of 12 blocks and has 2 requests in flight: B computes 2 blocks and pulls
    10 (at a quarter of a computed token each) for 32 + 40 = 72 tokens, against A's
    32 + 128 = 160."""
    d = choose([A, B], Inputs({A: s(10)}, {A: 2}, PROMPT, sources=[A, B], pull_tokens=flat(0.25)))
    assert (d.instance, d.source) == (B, A) and d.cost == pytest.approx(2 * BS + 40)
    idle = choose([A, B], Inputs({A: s(10)}, {}, PROMPT, sources=[A, B], pull_tokens=flat(0.25)))
    assert (idle.instance, idle.source) == (A, None)  # unloaded, the holder runs it


def test_a_pull_that_costs_as_much_as_computing_is_not_made() -> None:
    d = choose([A, B], Inputs({A: s(10)}, {A: 5}, PROMPT, sources=[A], pull_tokens=flat(1.0)))
    assert d.instance == B and d.source is None  # equal cost: computed, no pull


def test_a_candidate_pulls_only_what_the_source_holds_beyond_its_own() -> None:
    pulled: list[int] = []

    def cost(source: str, instance: str, n: int) -> float:
        pulled.append(n)
        return 0.1 * n

    d = choose([B], Inputs({A: s(10), B: s(4)}, {}, PROMPT, sources=[A], pull_tokens=cost))
    assert pulled == [6 * BS] and (d.instance, d.source) == (B, A)
    assert d.cost == pytest.approx(2 * BS + 0.1 * 6 * BS)


def test_without_sources_the_choice_is_todays() -> None:
    rng = random.Random(3)
    for _ in range(300):
        names = [A, B, C]
        scores = {n: s(rng.randrange(13)) for n in names if rng.random() < 0.7}
        loads = {n: rng.randrange(4) for n in names}
        key = rng.randrange(1 << 30)
        today = choose(names, Inputs(scores, loads, PROMPT, spread_key=key))
        no_sources = choose(
            names, Inputs(scores, loads, PROMPT, spread_key=key, sources=[], pull_tokens=flat(0.25))
        )
        no_cost = choose(names, Inputs(scores, loads, PROMPT, spread_key=key, sources=names))
        assert no_sources == today and no_cost == today


def test_a_measured_queue_cost_replaces_the_load_weight() -> None:
    """A holds 10 of 12 blocks with 2 in flight: at 64 tokens a request B pulls (as above);
    where A's queue was measured at 10 tokens a request, A runs it."""
    loads = {A: 2}
    pulled = choose([A, B], Inputs({A: s(10)}, loads, PROMPT, sources=[A], pull_tokens=flat(0.25)))
    assert pulled.instance == B
    cheap = choose(
        [A, B],
        Inputs(
            {A: s(10)},
            loads,
            PROMPT,
            sources=[A],
            pull_tokens=flat(0.25),
            load_tokens=lambda _name, n: 10.0 * n,
        ),
    )
    assert (cheap.instance, cheap.source, cheap.cost) == (A, None, 2 * BS + 20)


def test_the_tokens_a_holder_has_still_to_compute_count_against_it() -> None:
    """A holds 10 of 12 blocks with one request in flight, measured at 10 tokens a request:
    alone it runs the next one (32 + 10 = 42 against B's pull, 32 + 40 = 72). With 64
    prompt tokens still to compute for that request, A costs 106: B pulls. The decision says
    what its instance computes: 2 blocks either way."""
    names, args = [A, B], ({A: s(10)}, {A: 1}, PROMPT)
    measured = {"sources": [A], "pull_tokens": flat(0.25), "load_tokens": lambda _n, k: 10.0 * k}
    idle = choose(names, Inputs(*args, **measured, pending={A: 0}))  # type: ignore[arg-type]
    assert (idle.instance, idle.source, idle.cost, idle.computed) == (A, None, 42, 2 * BS)
    busy = choose(names, Inputs(*args, **measured, pending={A: 64}))  # type: ignore[arg-type]
    assert (busy.instance, busy.source, busy.cost, busy.computed) == (B, A, 72, 2 * BS)
    today = choose(names, Inputs(*args, pending={A: 64}))  # without pulls: load weight only
    assert (today.instance, today.cost) == (A, 2 * BS + 64)


def test_a_slower_instances_tokens_count_for_more() -> None:
    """Nothing cached, A with one request in flight (64 tokens of load), B idle: B runs it,
    as today. With B measured 1.5x slower than typical and A 0.5x, A's 192 + 64 tokens take
    128 typical ones and B's 192 take 288: A runs it. A pull is scaled as the candidate's own
    compute is: A holding 10 blocks with its queue measured at 10 tokens runs the next
    request (2 blocks and 10: 42) rather than B pulling (2 blocks and a 40-token pull: 72),
    unless B is more than 72 / 42 times as fast as A."""
    cold = choose([A, B], Inputs({}, {A: 1}, PROMPT))
    assert cold.instance == B
    scaled = choose([A, B], Inputs({}, {A: 1}, PROMPT, time_scale={A: 0.5, B: 1.5}))
    assert (scaled.instance, scaled.cost) == (A, (PROMPT + 64) * 0.5)
    names, args = [A, B], ({A: s(10)}, {A: 1}, PROMPT)
    pull = {"sources": [A], "pull_tokens": flat(0.25), "load_tokens": lambda _n, k: 10.0 * k}
    even = choose(names, Inputs(*args, **pull))  # type: ignore[arg-type]
    assert (even.instance, even.source, even.cost) == (A, None, 2 * BS + 10)
    faster_b = choose(names, Inputs(*args, **pull, time_scale={A: 1.0, B: 0.5}))  # type: ignore[arg-type]
    assert (faster_b.instance, faster_b.source, faster_b.cost) == (B, A, (2 * BS + 40) * 0.5)
