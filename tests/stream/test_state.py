"""StreamState and snapshots: a consumer that applies a snapshot and then the batches after
its fence ends with exactly what one that read the whole stream has."""

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconnect.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvconnect.stream.publisher import ZmqEventPublisher
from kvconnect.stream.state import StreamState
from kvconnect.stream.subscriber import (
    EventsLost,
    KVEventSubscriber,
    ReceivedBatch,
    StreamSnapshot,
    SubscriberItem,
)
from tests.helpers import poll_until, tcp_pair

BS = 4
MEDIA = [("GPU", None), ("CPU", None), ("STORAGE", "LOCAL"), ("STORAGE", "REMOTE")]
"""(medium, locality): a disk and a Redis are both STORAGE."""


def held(events: list) -> Counter[tuple[str | None, str | None, int, tuple[int, ...]]]:
    """(medium, locality, hash, the block's tokens) counts that `events` leave, in order."""
    out: Counter[tuple[str | None, str | None, int, tuple[int, ...]]] = Counter()
    tokens: dict[tuple[str | None, str | None, int], tuple[int, ...]] = {}
    for ev in events:
        if isinstance(ev, BlockStored):
            for i, h in enumerate(ev.block_hashes):
                toks = tuple(ev.token_ids[i * BS : (i + 1) * BS])
                key = (ev.medium, ev.locality, h)
                if key not in tokens or not any(k[:3] == key for k in out):
                    tokens[key] = toks
                out[(*key, tokens[key])] += 1
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                match = next((k for k in out if k[:3] == (ev.medium, ev.locality, h)), None)
                if match is not None:
                    out[match] -= 1
                    if not out[match]:
                        del out[match]
        elif isinstance(ev, AllBlocksCleared):
            out.clear()
    return out


def random_events(rng: random.Random, n: int) -> list:
    events: list = []
    for _ in range(n):
        r = rng.random()
        medium, locality = rng.choice(MEDIA)
        if r < 0.6:
            k = rng.randint(1, 4)
            start = rng.randrange(30)
            hashes = list(range(start, start + k))
            parent = start - 1 if start else None
            toks = [h * 100 + j for h in hashes for j in range(BS)]
            events.append(
                BlockStored(hashes, parent, toks, BS, None, medium, None, locality=locality)
            )
        elif r < 0.97:
            removed = rng.sample(range(34), rng.randint(1, 3))
            events.append(BlockRemoved(removed, medium, locality=locality))
        else:
            events.append(AllBlocksCleared())
    return events


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32), st.integers(0, 120))
def test_a_snapshot_holds_exactly_what_the_events_leave(seed: int, n: int) -> None:
    events = random_events(random.Random(seed), n)
    state = StreamState()
    for seq, ev in enumerate(events):
        state.apply(seq, KVEventBatch(0.0, [ev]))
    state.check_integrity()
    snapshot = state.events()
    assert held(snapshot) == held(events)
    for ev in snapshot:  # every event is well formed: its tokens are its blocks'
        assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
    assert state.seq == n - 1 and len(state) == len({k[:3] for k in held(events)})


def test_a_secondary_tiers_residency_is_counted_apart_from_the_engines() -> None:
    """vLLM 0.33's KVCR marks its events `ownership="kvcr"`: its removal of a block leaves the
    engine's own CPU copy of it (vLLM's offloading connector keys residency so too)."""
    toks = [1, 2, 3, 4, 5, 6, 7, 8]
    own = BlockStored([1, 2], None, toks, BS, None, "CPU", None)
    kvcr = BlockStored([1, 2], None, toks, BS, None, "CPU", None, ownership="kvcr")
    state = StreamState()
    state.apply(0, KVEventBatch(0.0, [own, kvcr]))
    assert len(state) == 4
    state.apply(1, KVEventBatch(0.0, [BlockRemoved([1, 2], "CPU", ownership="kvcr")]))
    state.check_integrity()
    assert state.events() == [own]
    state.apply(2, KVEventBatch(0.0, [kvcr, BlockRemoved([1, 2], "CPU")]))
    assert state.events() == [kvcr]  # the snapshot re-announces it as the secondary tier's


def test_one_hash_on_a_local_and_a_remote_storage_is_two_entries() -> None:
    """A disk and a Redis are both STORAGE: the locality tells their copies apart."""
    toks = [1, 2, 3, 4, 5, 6, 7, 8]
    disk = BlockStored([1, 2], None, toks, BS, None, "STORAGE", None, locality="LOCAL")
    redis = BlockStored([1, 2], None, toks, BS, None, "STORAGE", None, locality="REMOTE")
    state = StreamState()
    state.apply(0, KVEventBatch(0.0, [disk, redis]))
    assert len(state) == 4
    state.check_integrity()
    assert sorted(state.events(), key=lambda e: e.locality or "") == [disk, redis]
    state.apply(1, KVEventBatch(0.0, [BlockRemoved([1, 2], "STORAGE", locality="LOCAL")]))
    assert len(state) == 2 and state.events() == [redis]  # the Redis copy stays, REMOTE
    # A removal must name the locality: STORAGE alone (or the older EXTERNAL) is another tier.
    state.apply(2, KVEventBatch(0.0, [BlockRemoved([1], "STORAGE")]))
    state.apply(3, KVEventBatch(0.0, [BlockRemoved([1], "EXTERNAL")]))
    assert state.events() == [redis]
    state.apply(4, KVEventBatch(0.0, [BlockRemoved([1], "STORAGE", locality="REMOTE")]))
    (left,) = state.events()
    assert (left.block_hashes, left.medium, left.locality) == ([2], "STORAGE", "REMOTE")
    assert left.token_ids == toks[BS:] and left.parent_block_hash == 1
    state.check_integrity()


def fold(items: list[SubscriberItem]) -> Counter:
    """What a consumer holds after `items`: a snapshot replaces, batches apply."""
    events: list = []
    for item in items:
        if isinstance(item, StreamSnapshot):
            events = [AllBlocksCleared(), *item.batch.events]
        elif isinstance(item, ReceivedBatch):
            events.extend(item.batch.events)
    return held(events)


def collect(sub: KVEventSubscriber, until_seq: int, timeout: float = 10.0) -> list[SubscriberItem]:
    items: list[SubscriberItem] = []
    last = -1
    while last < until_seq:
        item = sub.recv(timeout=timeout)
        assert item is not None, f"stalled at seq {last}: {items[-3:]}"
        items.append(item)
        if isinstance(item, ReceivedBatch | StreamSnapshot):
            last = item.seq
    return items


def test_a_late_subscriber_gets_the_whole_state_though_the_ring_dropped_its_history() -> None:
    ep, rp = tcp_pair()
    pub = ZmqEventPublisher.open(bind=True, endpoint=ep, replay_endpoint=rp, buffer_steps=10)
    events = random_events(random.Random(5), 300)
    try:
        for ev in events[:200]:
            pub.publish(KVEventBatch(0.0, [ev]))
        with KVEventSubscriber(ep, rp, start_seq=0, snapshots=True) as sub:
            first = collect(sub, 199)
            assert isinstance(first[0], StreamSnapshot) and first[0].seq == 199
            assert sub.caught_up == {ep} and sub.num_queued == 0  # all of it yielded
            assert sub.num_snapshots == 1 and not any(isinstance(i, EventsLost) for i in first)
            assert pub.wait_for_subscriber()
            for ev in events[200:]:
                pub.publish(KVEventBatch(0.0, [ev]))
            rest = collect(sub, 299)
        assert [i.seq for i in rest if isinstance(i, ReceivedBatch)] == list(range(200, 300))
        assert fold(first + rest) == held(events)
        # Without snapshots the same subscriber can only report the loss.
        with KVEventSubscriber(ep, rp, start_seq=0) as plain:
            items = collect(plain, 299)
            assert isinstance(items[0], EventsLost) and (items[0].first_seq, items[0].last_seq) == (
                0,
                289,
            )
    finally:
        pub.shutdown()


def test_a_loss_replay_cannot_repair_is_followed_by_a_snapshot() -> None:
    """A subscriber that falls behind the ring (the publisher's live queue overflowed while it
    was away) reports the loss, then gets a snapshot, then goes on: its view is the truth."""
    from tests.stream.test_publisher import StalledPublisher

    ep, rp = tcp_pair()
    StalledPublisher.release.clear()
    pub = StalledPublisher.open(
        bind=True, endpoint=ep, replay_endpoint=rp, max_queue_size=2, buffer_steps=5
    )
    events = random_events(random.Random(11), 60)
    sub = KVEventSubscriber(ep, rp, snapshots=True)
    try:
        assert pub.wait_for_subscriber()
        assert poll_until(sub, lambda: sub.num_handshakes == 1) == []  # first contact: empty
        for ev in events[:50]:  # 0, 1 queued live; 2..49 dropped live, ring keeps 45..49
            pub.publish(KVEventBatch(0.0, [ev]))
        StalledPublisher.release.set()
        assert pub.flush()
        for ev in events[50:]:
            pub.publish(KVEventBatch(0.0, [ev]))
        items = collect(sub, 59)
        lost = [i for i in items if isinstance(i, EventsLost)]
        assert lost and sub.num_snapshots >= 1
        assert fold(items) == held(events)
    finally:
        StalledPublisher.release.set()
        sub.close()
        pub.shutdown()


def test_an_empty_or_fresh_publisher_needs_no_snapshot() -> None:
    ep, rp = tcp_pair()
    pub = ZmqEventPublisher.open(bind=True, endpoint=ep, replay_endpoint=rp)
    try:
        with KVEventSubscriber(ep, rp, start_seq=0, snapshots=True) as sub:
            assert pub.wait_for_subscriber()
            assert poll_until(sub, lambda: sub.num_handshakes == 1) == []
            pub.publish(KVEventBatch(0.0, [AllBlocksCleared()]))
            items = collect(sub, 0)
            assert [type(i) for i in items] == [ReceivedBatch] and sub.num_snapshots == 0
    finally:
        pub.shutdown()


@pytest.mark.parametrize("num_blocks", [0, 5000])
def test_a_snapshot_travels_in_batches_and_arrives_whole(num_blocks: int) -> None:
    ep, rp = tcp_pair()
    pub = ZmqEventPublisher.open(bind=True, endpoint=ep, replay_endpoint=rp, buffer_steps=1)
    hashes = list(range(num_blocks))
    try:
        pub.publish(KVEventBatch(0.0, [AllBlocksCleared()]))
        for i in range(0, num_blocks, 50):  # chains of 50 blocks, each block its own event
            for h in hashes[i : i + 50]:
                ev = BlockStored([h], h - 1 if h % 50 else None, [h] * BS, BS, None, "CPU", None)
                pub.publish(KVEventBatch(0.0, [ev]))
        pub.publish(KVEventBatch(0.0, [BlockRemoved([7], "CPU")]))
        with KVEventSubscriber(ep, rp, snapshots=True) as sub:
            items = collect(sub, num_blocks + 1)
        assert isinstance(items[0], StreamSnapshot)
        got = sorted(h for ev in items[0].batch.events for h in ev.block_hashes)
        assert got == [h for h in hashes if h != 7]
    finally:
        pub.shutdown()


def test_caught_up_names_a_publisher_only_once_its_state_is_queued_whole() -> None:
    """A router waits for `caught_up` before its first decision: a publisher whose replay
    socket does not answer is not caught up; once it answers (a fresh subscriber), it is."""
    ep, rp = tcp_pair()
    _, silent = tcp_pair()  # nothing listens there
    pub = ZmqEventPublisher.open(bind=True, endpoint=ep, replay_endpoint=rp)
    try:
        pub.publish(KVEventBatch(0.0, [AllBlocksCleared()]))
        with KVEventSubscriber(ep, silent, start_seq=0, snapshots=True, replay_timeout=0.2) as sub:
            poll_until(sub, lambda: sub.num_replay_failures >= 1)
            assert sub.num_handshakes >= 1 and sub.caught_up == set()
        with KVEventSubscriber(ep, rp, start_seq=0, snapshots=True) as sub:
            poll_until(sub, lambda: sub.num_handshakes == 1)
            assert sub.caught_up == {ep}
    finally:
        pub.shutdown()
