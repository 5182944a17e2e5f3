import logging
import random
from functools import reduce

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconnect.connector.events import EventQuorum, KVEventsWorkerMetadata
from kvconnect.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


def stored(h: int, medium: str = "CPU") -> BlockStored:
    return BlockStored([h], None, [1, 2, 3, 4], 4, None, medium, None)


A, B, C = stored(1), stored(2), stored(3)


def step(q: EventQuorum, **per_rank: list[KVCacheEvent]) -> list[KVCacheEvent]:
    """One step in which rank r reported per_rank[f"r{r}"]; returns what the quorum released."""
    metas = [KVEventsWorkerMetadata.from_rank(int(k[1:]), v) for k, v in per_rank.items() if v]
    q.update(reduce(lambda a, b: a.aggregate(b), metas) if metas else None)
    q.check_integrity()
    return q.take_events()


def test_single_worker_releases_at_once_then_drains() -> None:
    q = EventQuorum(world_size=1)
    assert step(q, r0=[A, B]) == [A, B]
    assert step(q) == []
    assert q.num_pending == 0


def test_only_events_every_rank_reported_are_released() -> None:
    q = EventQuorum(world_size=3)
    assert step(q, r0=[A, B], r1=[A], r2=[A]) == [A]
    assert q.num_pending == 1  # B waits for ranks 1 and 2


def test_rank_reporting_in_a_later_step_releases_exactly_once() -> None:
    q = EventQuorum(world_size=2)
    assert step(q, r0=[A]) == []
    assert step(q) == []
    assert step(q, r1=[A]) == [A]
    assert step(q, r0=[A]) == []  # a new occurrence, not a duplicate release
    assert q.num_pending == 1


def test_duplicate_reports_from_one_rank_never_fake_quorum() -> None:
    q = EventQuorum(world_size=2)
    assert step(q, r0=[A, A]) == []
    assert step(q, r0=[A]) == []
    assert step(q, r1=[A]) == [A]  # one occurrence complete, two more wait for rank 1
    assert step(q, r1=[A, A]) == [A, A]
    assert q.num_pending == 0


def test_replication_count_releases_when_the_holding_ranks_report() -> None:
    q = EventQuorum(world_size=4, required_ranks=1)  # e.g. MLA: one rank holds the KV
    assert step(q, r0=[A, B]) == [A, B]
    q2 = EventQuorum(world_size=4, required_ranks=2)
    assert step(q2, r1=[A]) == []
    assert step(q2, r3=[A]) == [A]


def test_partial_events_expire_after_a_bounded_number_of_steps(
    caplog: pytest.LogCaptureFixture,
) -> None:
    q = EventQuorum(world_size=4, max_pending_steps=3)
    with caplog.at_level(logging.WARNING):
        assert step(q, r0=[A, B, C], r1=[A, B], r2=[A], r3=[A]) == [A]
        assert step(q) == [] and step(q) == []
        assert q.num_pending == 2 and q.num_expired == 0
        assert step(q) == []
    assert q.num_pending == 0 and q.num_expired == 2
    assert "dropped 1 occurrence(s) of BlockStored reported by ranks [0, 1] only" in caplog.text


def test_all_blocks_cleared_takes_part_like_any_event() -> None:
    q = EventQuorum(world_size=2)
    clear = AllBlocksCleared()
    assert step(q, r0=[clear]) == []
    assert step(q, r1=[clear]) == [clear]


def test_events_differing_in_medium_do_not_meet() -> None:
    q = EventQuorum(world_size=2)
    assert step(q, r0=[stored(1, "cuda:0")], r1=[stored(1, "cuda:1")]) == []


def test_release_order_follows_reports() -> None:
    q = EventQuorum(world_size=2)
    removed = BlockRemoved([1], "CPU")
    assert step(q, r0=[A, removed], r1=[A, removed]) == [A, removed]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="required_ranks"):
        EventQuorum(world_size=2, required_ranks=3)
    with pytest.raises(ValueError, match="max_pending_steps"):
        EventQuorum(world_size=2, max_pending_steps=0)
    with pytest.raises(ValueError, match="rank 5"):
        EventQuorum(world_size=2).update(KVEventsWorkerMetadata.from_rank(5, [A]))
    with pytest.raises(TypeError):
        KVEventsWorkerMetadata().aggregate(object())  # type: ignore[arg-type]


metas = st.builds(
    KVEventsWorkerMetadata,
    st.dictionaries(
        st.integers(0, 3), st.lists(st.sampled_from([A, B, C]), max_size=3), max_size=3
    ),
)


@given(metas, metas, metas)
def test_aggregate_is_associative_and_order_independent(
    x: KVEventsWorkerMetadata, y: KVEventsWorkerMetadata, z: KVEventsWorkerMetadata
) -> None:
    # Within one step each rank reports once, so give the three disjoint rank sets.
    x = KVEventsWorkerMetadata({r: e for r, e in x.events_by_rank.items()})
    y = KVEventsWorkerMetadata({r + 4: e for r, e in y.events_by_rank.items()})
    z = KVEventsWorkerMetadata({r + 8: e for r, e in z.events_by_rank.items()})
    left = x.aggregate(y).aggregate(z)
    assert left == x.aggregate(y.aggregate(z))
    assert left == z.aggregate(x).aggregate(y)
    assert left.num_events == x.num_events + y.num_events + z.num_events


@settings(max_examples=200, deadline=None)
@given(
    world_size=st.integers(1, 4),
    num_events=st.integers(0, 12),
    seed=st.integers(0, 2**32),
)
def test_every_event_released_once_whatever_the_per_rank_delays(
    world_size: int, num_events: int, seed: int
) -> None:
    """Each rank reports the same event sequence, each event in a random later step."""
    rng = random.Random(seed)
    events = [stored(rng.randrange(4)) for _ in range(num_events)]  # repeats are real repeats
    q = EventQuorum(world_size, max_pending_steps=1000)
    schedule: dict[int, dict[int, list[KVCacheEvent]]] = {}
    for rank in range(world_size):
        t = 0
        for ev in events:
            t += rng.randrange(3)  # a rank keeps its own order but may lag the others
            schedule.setdefault(t, {}).setdefault(rank, []).append(ev)
    released: list[KVCacheEvent] = []
    for t in range(max(schedule, default=0) + 1):
        per_rank = schedule.get(t, {})
        released += step(q, **{f"r{r}": evs for r, evs in per_rank.items()})
    assert sorted(e.block_hashes[0] for e in released) == sorted(  # type: ignore[attr-defined]
        e.block_hashes[0] for e in events
    )
    assert q.num_pending == 0 and q.num_expired == 0


def test_silent_rank_means_no_quorum_not_a_smaller_one() -> None:
    # Upstream counts only the workers that reported; here the world size is the quorum.
    q = EventQuorum(world_size=4, max_pending_steps=2)
    assert step(q, r0=[A], r1=[A], r2=[A]) == []
    assert step(q) == [] and q.num_pending == 1
    assert step(q) == []  # two steps after the report: expired
    assert q.num_expired == 1 and q.num_pending == 0


def test_disjoint_reports_release_nothing() -> None:
    q = EventQuorum(world_size=3)
    assert step(q, r0=[A], r1=[B], r2=[C]) == []
    assert q.num_pending == 3
