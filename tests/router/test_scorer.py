import pytest

from kvconnect.router.index import PrefixScore
from kvconnect.router.scorer import choose

A, B, C = "a", "b", "c"
BS = 16
PROMPT = 12 * BS  # 12 full blocks of 16 tokens


def s(blocks: int, weighted: float | None = None, block_size: int = BS) -> PrefixScore:
    w = float(blocks) if weighted is None else weighted
    return PrefixScore(blocks, w, block_size=block_size)


def test_longer_cached_prefix_wins_at_equal_load() -> None:
    d = choose([A, B], {A: s(2), B: s(10)}, {}, PROMPT)
    assert d.instance == B and d.cost == pytest.approx(2.0 * BS)


def test_tier_weights_make_a_shorter_gpu_prefix_beat_a_longer_disk_one() -> None:
    assert choose([A, B], {A: s(6), B: s(10, 10 * 0.5)}, {}, PROMPT).instance == A


def test_load_outweighs_a_small_hit_but_not_a_large_one() -> None:
    assert choose([A, B], {A: s(2)}, {A: 1}, PROMPT).instance == B  # 32 tokens < 64 per request
    assert choose([A, B], {A: s(10)}, {A: 1}, PROMPT).instance == A


def test_cold_request_goes_to_the_least_loaded_and_ties_to_the_first() -> None:
    assert choose([A, B, C], {}, {A: 2, B: 0, C: 1}, PROMPT).instance == B
    assert choose([A, B, C], {}, {}, PROMPT).instance == A
    assert choose([A, B, C], {}, {}, PROMPT, num_chosen={A: 1, B: 1}).instance == C
    assert choose([A, B], {A: s(4)}, {A: 1, B: 0}, PROMPT).instance == B  # equal cost: less load


def test_shared_tier_score_counts_for_everyone() -> None:
    shared = s(10, 3.0)  # 10 EXTERNAL blocks at 0.3
    d = choose([A, B], {A: shared, B: s(4)}, {}, PROMPT)
    assert d.instance == B  # 4 GPU blocks beat 10 shared-store blocks


def test_instances_with_different_block_sizes_compare_in_tokens() -> None:
    # A holds 3 blocks of 32 tokens (96), B holds 5 blocks of 16 (80): A saves more prefill.
    assert choose([A, B], {A: s(3, block_size=32), B: s(5)}, {}, PROMPT).instance == A
    assert choose([A, B], {A: s(2, block_size=32), B: s(5)}, {}, PROMPT).instance == B


def test_no_candidates() -> None:
    with pytest.raises(ValueError, match="no instance"):
        choose([], {}, {}, 1)
