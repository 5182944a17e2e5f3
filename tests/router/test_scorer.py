import pytest

from kvconnect.router.index import PrefixScore
from kvconnect.router.scorer import choose

A, B, C = "a", "b", "c"


def s(blocks: int, weighted: float | None = None) -> PrefixScore:
    return PrefixScore(blocks, float(blocks) if weighted is None else weighted)


def test_longer_cached_prefix_wins_at_equal_load() -> None:
    d = choose([A, B], {A: s(2), B: s(10)}, {}, num_blocks=12)
    assert d.instance == B and d.cost == pytest.approx(2.0)


def test_tier_weights_make_a_shorter_gpu_prefix_beat_a_longer_disk_one() -> None:
    assert choose([A, B], {A: s(6), B: s(10, 10 * 0.5)}, {}, 12).instance == A


def test_load_outweighs_a_small_hit_but_not_a_large_one() -> None:
    assert choose([A, B], {A: s(2)}, {A: 1}, 12).instance == B  # 2 blocks < 4 per request
    assert choose([A, B], {A: s(10)}, {A: 1}, 12).instance == A


def test_cold_request_goes_to_the_least_loaded_and_ties_to_the_first() -> None:
    assert choose([A, B, C], {}, {A: 2, B: 0, C: 1}, 12).instance == B
    assert choose([A, B, C], {}, {}, 12).instance == A
    assert choose([A, B, C], {}, {}, 12, num_chosen={A: 1, B: 1}).instance == C
    assert choose([A, B], {A: s(4)}, {A: 1, B: 0}, 12).instance == B  # equal cost: less load


def test_shared_tier_score_counts_for_everyone() -> None:
    shared = s(10, 3.0)  # 10 EXTERNAL blocks at 0.3
    d = choose([A, B], {A: shared, B: s(4)}, {}, 12)
    assert d.instance == B  # 4 GPU blocks beat 10 shared-store blocks


def test_no_candidates() -> None:
    with pytest.raises(ValueError, match="no instance"):
        choose([], {}, {}, 1)
