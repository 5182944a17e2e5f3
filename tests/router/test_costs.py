"""The router's cost model (router/costs.py): fits that recover an instance's prefill,
decode and fixed times and a pair's pull cost from answers, follow an instance that changes,
and stand in for nothing until measured; and the prompt arithmetic of bursts."""

from __future__ import annotations

import math
import random

import pytest

from kvconnect.router.bursts import common_prefix
from kvconnect.router.costs import MAX_SCALE, PRIOR_PULL_RATIO, CostModel
from kvconnect.router.pd import min_tail_of


def answers(
    model: CostModel,
    rng: random.Random,
    n: int,
    fixed: float,
    prefill: float,
    decode: float,
    name: str = "b",
) -> None:
    for _ in range(n):
        computed, completion = rng.randrange(16, 4096), rng.randrange(1, 64)
        noise = rng.uniform(-0.002, 0.002)
        model.observe(
            name, fixed + prefill * computed + decode * completion + noise, computed, completion
        )


def test_an_instances_costs_are_fitted_from_its_answers() -> None:
    model = CostModel()
    rng = random.Random(1)
    assert model.instance("b") is None
    answers(model, rng, 30, fixed=0.05, prefill=0.002, decode=0.01)
    cost = model.instance("b")
    assert cost is not None
    assert cost.prefill_s_per_token == pytest.approx(0.002, rel=0.01)
    assert cost.decode_s_per_token == pytest.approx(0.01, rel=0.05)
    assert cost.fixed_s == pytest.approx(0.05, abs=0.005)


def test_answers_of_one_length_identify_no_prefill_cost() -> None:
    model = CostModel()
    for _ in range(20):
        model.observe("b", 0.5, 1000, 8)
    assert model.instance("b") is None
    assert model.pull_tokens("a", "b", 100) == PRIOR_PULL_RATIO * 100


def test_a_pairs_pull_cost_is_what_pulled_answers_took_beyond_the_instances_fit() -> None:
    model = CostModel()
    rng = random.Random(2)
    answers(model, rng, 30, fixed=0.05, prefill=0.002, decode=0.01)
    assert model.pull_tokens("a", "b", 1000) == PRIOR_PULL_RATIO * 1000  # not measured yet
    assert model.crossover("a", "b") is None
    for _ in range(20):
        computed, pulled = rng.randrange(16, 256), rng.randrange(256, 4096)
        elapsed = 0.05 + 0.002 * computed + 0.01 * 8 + 0.03 + 0.0001 * pulled
        model.observe("b", elapsed, computed, 8, source="a", pulled=pulled)
    pull = model.pull("a", "b")
    assert pull is not None
    assert pull.s_per_token == pytest.approx(0.0001, rel=0.05)
    assert pull.fixed_s == pytest.approx(0.03, abs=0.005)
    # 1000 pulled tokens take 0.13 s: 65 tokens of b's prefill
    assert model.pull_tokens("a", "b", 1000) == pytest.approx(65, rel=0.05)
    assert model.crossover("a", "b") == pytest.approx(0.03 / 0.0019, rel=0.05)
    assert model.pull("b", "a") is None  # a pair is directed


def test_a_pull_that_never_pays_has_no_crossover() -> None:
    model = CostModel()
    rng = random.Random(3)
    answers(model, rng, 30, fixed=0.05, prefill=0.001, decode=0.01)
    for _ in range(10):
        pulled = rng.randrange(256, 4096)
        model.observe("b", 0.05 + 0.08 + 0.01 + 0.002 * pulled, 0, 8, source="a", pulled=pulled)
    assert model.crossover("a", "b") == math.inf
    assert model.pull_tokens("a", "b", 1000) > 1000


def test_the_fit_follows_an_instance_that_slows_down() -> None:
    model = CostModel()
    rng = random.Random(4)
    answers(model, rng, 50, fixed=0.05, prefill=0.001, decode=0.01)
    answers(model, rng, 200, fixed=0.05, prefill=0.004, decode=0.01)
    cost = model.instance("b")
    assert cost is not None and cost.prefill_s_per_token == pytest.approx(0.004, rel=0.02)


def test_answers_that_measure_nothing_are_ignored() -> None:
    model = CostModel()
    rng = random.Random(5)
    answers(model, rng, 30, fixed=0.05, prefill=0.002, decode=0.01)
    before = model.instance("b")
    for bad in (math.nan, math.inf, -1.0):
        model.observe("b", bad, 100, 1)
    model.observe("b", 1.0, -5, 1)
    model.observe("b", 1.0, 100, 1, source="a", pulled=0)  # a pull that moved nothing
    assert model.instance("b") == before and model.pull("a", "b") is None


def test_p_d_disaggregates_past_the_pairs_measured_crossover_and_min_tail_until_then() -> None:
    model = CostModel()
    rng = random.Random(6)
    assert min_tail_of(model, "p", "d", 256) == 256  # nothing measured: the flag
    answers(model, rng, 30, fixed=0.05, prefill=0.002, decode=0.01, name="d")
    for _ in range(10):  # D's answers to P/D requests: what pulling from P took
        pulled = rng.randrange(256, 4096)
        model.observe("d", 0.05 + 0.01 * 8 + 0.2 + 0.0001 * pulled, 0, 8, "p", pulled)
    assert min_tail_of(model, "p", "d", 256) == pytest.approx(0.2 / 0.0019, rel=0.05)  # ~105
    assert min_tail_of(model, "p", "other", 256) == 256  # another pair: not measured


def test_common_prefix_counts_the_leading_tokens_two_prompts_share() -> None:
    rng = random.Random(7)
    for _ in range(200):
        a = [rng.randrange(4) for _ in range(rng.randrange(0, 40))]
        b = a[: rng.randrange(0, len(a) + 1)] + [
            rng.randrange(4) for _ in range(rng.randrange(0, 5))
        ]
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        assert common_prefix(a, b) == n


def test_pulls_of_one_size_give_a_cost_per_token() -> None:
    model = CostModel()
    rng = random.Random(8)
    answers(model, rng, 30, fixed=0.05, prefill=0.002, decode=0.01)
    for _ in range(3):
        model.observe("b", 0.05 + 0.002 * 16 + 0.01 * 8 + 0.2, 16, 8, source="a", pulled=2048)
    assert model.pull("a", "b") is None  # three answers: not yet
    model.observe("b", 0.05 + 0.002 * 16 + 0.01 * 8 + 0.2, 16, 8, source="a", pulled=2048)
    pull = model.pull("a", "b")
    assert pull is not None and pull.fixed_s == 0.0
    assert pull.s_per_token == pytest.approx(0.2 / 2048, rel=0.05)
    assert model.crossover("a", "b") == 0.0


def test_a_queue_costs_what_the_answers_say_once_they_came_at_different_loads() -> None:
    model = CostModel()
    rng = random.Random(9)
    answers(model, rng, 30, fixed=0.05, prefill=0.002, decode=0.01)
    assert model.load_tokens("b", 3, default_weight=64) == 3 * 64  # never seen loaded
    for _ in range(60):
        computed, queued = rng.randrange(16, 4096), rng.randrange(0, 6)
        elapsed = 0.05 + 0.002 * computed + 0.01 * 8 + 0.3 * queued + rng.uniform(-0.002, 0.002)
        model.observe("b", elapsed, computed, 8, queued=queued)
    cost = model.instance("b")
    assert cost is not None and cost.queue_s_per_request == pytest.approx(0.3, rel=0.05)
    assert model.load_tokens("b", 2, default_weight=64) == pytest.approx(2 * 0.3 / 0.002, rel=0.05)
    assert model.load_tokens("a", 2, default_weight=64) == 128  # another instance


def test_pulled_answers_before_the_instances_fit_count_once_it_stands() -> None:
    model = CostModel()
    rng = random.Random(10)
    for _ in range(6):  # pulls first: the instance has no fit yet
        pulled = rng.randrange(256, 4096)
        model.observe(
            "b", 0.05 + 0.002 * 16 + 0.01 * 8 + 0.03 + 0.0001 * pulled, 16, 8, "a", pulled
        )
    assert model.pull("a", "b") is None
    answers(model, rng, 30, fixed=0.05, prefill=0.002, decode=0.01)
    pull = model.pull("a", "b")
    assert pull is not None and pull.s_per_token == pytest.approx(0.0001, rel=0.1)


def test_time_scale_is_each_fitted_instances_prefill_against_the_median() -> None:
    """Three instances measured at 1, 2 and 4 ms a token: 0.5, 1 and 2 times the median. One
    measured alone says nothing (no scale); one measured 100x slower counts as MAX_SCALE."""
    model = CostModel()
    rng = random.Random(5)
    answers(model, rng, 30, fixed=0.05, prefill=0.001, decode=0.01, name="a")
    assert model.time_scale(["a", "b", "c"]) == {}
    answers(model, rng, 30, fixed=0.05, prefill=0.002, decode=0.01, name="b")
    answers(model, rng, 30, fixed=0.05, prefill=0.004, decode=0.01, name="c")
    scale = model.time_scale(["a", "b", "c", "unmeasured"])
    assert set(scale) == {"a", "b", "c"}
    assert scale["a"] == pytest.approx(0.5, rel=0.02)
    assert scale["b"] == pytest.approx(1.0)
    assert scale["c"] == pytest.approx(2.0, rel=0.02)
    answers(model, rng, 30, fixed=0.05, prefill=0.2, decode=0.01, name="slow")
    assert model.time_scale(["a", "b", "slow"])["slow"] == MAX_SCALE
