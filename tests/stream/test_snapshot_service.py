"""vLLM PR #57789's contract on real ZMQ sockets: publisher id in the live seq frame, idle
heartbeats, the snapshot service and the subscriber's exact resume after it; and nothing of it
on the wire without a snapshot endpoint."""

from __future__ import annotations

import random
import time
from typing import Any

import msgspec
import zmq

from kvconnect.events import KVEventBatch, decode_batch
from kvconnect.stream.publisher import ZmqEventPublisher
from kvconnect.stream.subscriber import (
    EventsLost,
    KVEventSubscriber,
    PublisherRestarted,
    ReceivedBatch,
    StreamSnapshot,
    SubscriberItem,
)
from kvconnect.stream.wire import HEARTBEAT_INTERVAL_S
from tests.helpers import free_port, wait_for
from tests.stream.test_state import held, random_events


def endpoints() -> tuple[str, str]:
    """(live, snapshot) on free loopback ports."""
    port = free_port(2)
    return f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"


def raw_sub(endpoint: str) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


def next_message(sock: zmq.Socket[bytes], timeout: float) -> list[bytes] | None:
    return sock.recv_multipart() if sock.poll(int(timeout * 1000)) else None


def ask_snapshot(endpoint: str) -> list[bytes]:
    """A REQ client's request (any one frame, as the PR takes it) and the answer."""
    req: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    try:
        req.connect(endpoint)
        req.send(b"please")
        assert req.poll(5000), "no snapshot answer"
        return req.recv_multipart()
    finally:
        req.close()


def test_without_a_snapshot_endpoint_the_wire_is_vllms_8_byte_seq_and_idle_is_silent() -> None:
    live, _ = endpoints()
    pub = ZmqEventPublisher.open(bind=True, endpoint=live)
    sock = raw_sub(live)
    try:
        assert pub.wait_for_subscriber()
        pub.publish(KVEventBatch(1.0, []))
        frames = next_message(sock, 5.0)
        assert frames is not None and frames[1] == (0).to_bytes(8, "big")
        assert pub.publisher_id is None
        assert next_message(sock, HEARTBEAT_INTERVAL_S * 1.5) is None  # no heartbeat
        assert pub.num_heartbeats == 0
    finally:
        sock.close()
        pub.shutdown()


def test_with_a_snapshot_endpoint_live_frames_carry_the_id_and_an_idle_second_a_heartbeat() -> None:
    live, snap = endpoints()
    pub = ZmqEventPublisher.open(bind=True, endpoint=live, snapshot_endpoint=snap)
    sock = raw_sub(live)
    try:
        assert pub.wait_for_subscriber()
        assert pub.publisher_id is not None and len(pub.publisher_id) == 16
        pub.publish(KVEventBatch(1.0, random_events(random.Random(1), 3)))
        sent = time.monotonic()
        frames = next_message(sock, 5.0)
        assert frames is not None and frames[1] == (0).to_bytes(8, "big") + pub.publisher_id
        beat = next_message(sock, HEARTBEAT_INTERVAL_S * 3)
        waited = time.monotonic() - sent
        assert beat is not None and beat[1] == (1).to_bytes(8, "big") + pub.publisher_id
        # A heartbeat is an ordinary (empty) batch of vLLM's form, with the publisher's rank.
        heartbeat = decode_batch(beat[2])
        assert (heartbeat.events, heartbeat.data_parallel_rank) == ([], 0)
        assert msgspec.msgpack.decode(beat[2])[1:] == [[], 0]
        assert HEARTBEAT_INTERVAL_S * 0.9 <= waited < HEARTBEAT_INTERVAL_S * 3
        assert pub.num_heartbeats >= 1
    finally:
        sock.close()
        pub.shutdown()


def test_the_snapshot_is_the_state_the_events_leave_at_the_seq_it_names() -> None:
    live, snap = endpoints()
    pub = ZmqEventPublisher.open(bind=True, endpoint=live, snapshot_endpoint=snap)
    events = random_events(random.Random(7), 120)
    try:
        first = ask_snapshot(snap)  # nothing published yet: seq -1, one empty batch
        assert first[0] == (-1).to_bytes(8, "big", signed=True)
        assert first[1] == pub.publisher_id and decode_batch(first[2]).events == []
        for ev in events:
            pub.publish(KVEventBatch(0.0, [ev]))
        answer = ask_snapshot(snap)
        seq = int.from_bytes(answer[0], "big", signed=True)
        assert seq == pub.num_published - 1 == len(events) - 1 + pub.num_heartbeats
        assert answer[1] == pub.publisher_id
        snapshot: list[Any] = [e for payload in answer[2:] for e in decode_batch(payload).events]
        assert held(snapshot) == held(events)
    finally:
        pub.shutdown()


def read(sub: KVEventSubscriber, until: Any, timeout: float = 10.0) -> list[SubscriberItem]:
    items: list[SubscriberItem] = []
    deadline = time.monotonic() + timeout
    while not until(items):
        assert time.monotonic() < deadline, f"not met in time: {items[-3:]}"
        item = sub.recv(timeout=0.05)
        if item is not None:
            items.append(item)
    return items


def state_of(items: list[SubscriberItem]) -> Any:
    from kvconnect.events import AllBlocksCleared

    events: list[Any] = []
    for item in items:
        if isinstance(item, StreamSnapshot):
            events = [AllBlocksCleared(), *item.batch.events]
        elif isinstance(item, ReceivedBatch):
            events.extend(item.batch.events)
    return held(events)


def last_seq_is(seq: int) -> Any:
    return lambda items: any(
        isinstance(i, ReceivedBatch | StreamSnapshot) and i.seq >= seq for i in items
    )


def test_a_late_subscriber_bootstraps_from_the_snapshot_and_resumes_exactly_after_it() -> None:
    """No replay endpoint: only the snapshot can give the history. The PR's sequence: a live
    message first (a heartbeat at the latest), the snapshot at seq S, then S+1, S+2, ..."""
    live, snap = endpoints()
    pub = ZmqEventPublisher.open(bind=True, endpoint=live, snapshot_endpoint=snap)
    events = random_events(random.Random(11), 200)
    try:
        for ev in events[:150]:
            pub.publish(KVEventBatch(0.0, [ev]))
        with KVEventSubscriber(live, snapshots=True, snapshot_endpoint=snap) as sub:
            items = read(sub, lambda items: any(isinstance(i, StreamSnapshot) for i in items))
            snapshot = next(i for i in items if isinstance(i, StreamSnapshot))
            assert snapshot.seq >= 149 and sub.caught_up == {live}
            assert sub.num_bootstraps == 1
            assert pub.wait_for_subscriber()
            for ev in events[150:]:
                pub.publish(KVEventBatch(0.0, [ev]))
            items += read(sub, last_seq_is(pub.num_published - 1))
        after = [i.seq for i in items if isinstance(i, ReceivedBatch) and i.seq > snapshot.seq]
        assert after == list(range(snapshot.seq + 1, after[-1] + 1))  # consecutive, once each
        assert not any(isinstance(i, EventsLost | PublisherRestarted) for i in items)
        assert state_of(items) == held(events)
    finally:
        pub.shutdown()


def test_a_restarted_publisher_is_known_by_its_new_id_and_bootstrapped_again() -> None:
    live, snap = endpoints()
    events = random_events(random.Random(3), 80)
    first = ZmqEventPublisher.open(bind=True, endpoint=live, snapshot_endpoint=snap)
    with KVEventSubscriber(live, snapshots=True, snapshot_endpoint=snap) as sub:
        try:
            for ev in events[:40]:
                first.publish(KVEventBatch(0.0, [ev]))
            items = read(sub, lambda items: any(isinstance(i, StreamSnapshot) for i in items))
        finally:
            first.shutdown()
        opened: list[ZmqEventPublisher] = []

        def bound() -> bool:  # libzmq releases a closed socket's port asynchronously
            try:
                opened.append(
                    ZmqEventPublisher.open(bind=True, endpoint=live, snapshot_endpoint=snap)
                )
            except RuntimeError:
                return False
            return True

        wait_for(bound, timeout=5, interval=0.05)
        second = opened[0]
        try:
            assert second.publisher_id != first.publisher_id
            for ev in events[40:]:
                second.publish(KVEventBatch(0.0, [ev]))
            # the new publisher's heartbeats (or a batch) reach the reconnected subscriber
            items += read(sub, lambda items: sub.num_bootstraps == 2 and sub.num_queued == 0)
        finally:
            second.shutdown()
    restarts = [i for i in items if isinstance(i, PublisherRestarted)]
    assert len(restarts) == 1
    after = items[items.index(restarts[0]) :]
    assert isinstance(
        next(i for i in after if not isinstance(i, PublisherRestarted)), (StreamSnapshot)
    )
    assert state_of(after) == held(events[40:])
