import itertools
import json
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvconnect.events import encode_batch
from kvconnect.publisher import END_SEQ, ZmqEventPublisher
from kvconnect.subscriber import (
    EventsLost,
    KVEventSubscriber,
    PublisherRestarted,
    ReceivedBatch,
    StreamId,
    SubscriberItem,
)
from tests.helpers import SETTLE_S, batch_id, make_batch, replay_request, tcp_pair
from tests.test_publisher import StalledPublisher


def drain(sub: KVEventSubscriber, idle: float = 0.5) -> list[SubscriberItem]:
    """Every item until none arrives for `idle` seconds."""
    items = []
    while (item := sub.recv(timeout=idle)) is not None:
        items.append(item)
    return items


def seqs(items: list[SubscriberItem]) -> list[int]:
    return [i.seq for i in items if isinstance(i, ReceivedBatch)]


def test_yields_seq_and_batch_in_order() -> None:
    ep, rp = tcp_pair()
    pub = ZmqEventPublisher(endpoint=ep, replay_endpoint=rp, topic="kv")
    sub = KVEventSubscriber(ep, rp, topic="kv")
    time.sleep(SETTLE_S)
    try:
        for i in range(20):
            pub.publish(make_batch(i, num_events=3))
        items = drain(sub)
        assert seqs(items) == list(range(20))
        seq, batch = items[5]  # type: ignore[misc]
        assert seq == 5 and batch_id(batch) == 5
        assert items[0].stream == StreamId(ep, "kv", 0)  # type: ignore[union-attr]
        assert sub.num_gaps_repaired == 0
    finally:
        sub.close()
        pub.shutdown()


def test_gap_is_repaired_from_replay_before_later_batches() -> None:
    ep, rp = tcp_pair()
    StalledPublisher.release.clear()
    pub = StalledPublisher(endpoint=ep, replay_endpoint=rp, max_queue_size=3)
    sub = KVEventSubscriber(ep, rp)
    time.sleep(SETTLE_S)
    try:
        for i in range(10):  # 0..2 queued live, 3..9 dropped from the live path
            pub.publish(make_batch(i))
        StalledPublisher.release.set()
        time.sleep(SETTLE_S)
        pub.publish(make_batch(10))  # live 10 after live 2: the gap 3..9 is fetched first
        items = drain(sub)
        assert seqs(items) == list(range(11))
        assert [batch_id(i.batch) for i in items if isinstance(i, ReceivedBatch)] == list(range(11))
        assert sub.num_gaps_repaired == 1 and sub.num_batches_replayed == 7
    finally:
        StalledPublisher.release.set()
        sub.close()
        pub.shutdown()


def test_ring_overrun_is_reported_as_events_lost() -> None:
    ep, rp = tcp_pair()
    StalledPublisher.release.clear()
    pub = StalledPublisher(endpoint=ep, replay_endpoint=rp, max_queue_size=2, buffer_steps=5)
    sub = KVEventSubscriber(ep, rp)
    time.sleep(SETTLE_S)
    try:
        for i in range(20):  # live: 0, 1; the ring then holds 15..19
            pub.publish(make_batch(i))
        StalledPublisher.release.set()
        time.sleep(SETTLE_S)
        pub.publish(make_batch(20))  # ring now 16..20
        items = drain(sub)
        lost = [i for i in items if isinstance(i, EventsLost)]
        assert lost == [EventsLost(StreamId(ep, "", 0), 2, 15)]
        assert seqs(items) == [0, 1, *range(16, 21)]
        assert items.index(lost[0]) == 2  # reported where the missing batches belong
        assert sub.num_batches_lost == 14
    finally:
        StalledPublisher.release.set()
        sub.close()
        pub.shutdown()


def test_gap_without_replay_endpoint_is_lost_not_hidden() -> None:
    ep, _ = tcp_pair()
    StalledPublisher.release.clear()
    pub = StalledPublisher(endpoint=ep, max_queue_size=1)
    sub = KVEventSubscriber(ep)
    time.sleep(SETTLE_S)
    try:
        for i in range(4):
            pub.publish(make_batch(i))
        StalledPublisher.release.set()
        time.sleep(SETTLE_S)
        pub.publish(make_batch(4))
        items = drain(sub)
        assert seqs(items) == [0, 4]
        assert [i for i in items if isinstance(i, EventsLost)] == [
            EventsLost(StreamId(ep, "", 0), 1, 3)
        ]
    finally:
        StalledPublisher.release.set()
        sub.close()
        pub.shutdown()


def test_start_seq_zero_catches_up_the_slow_joiner_gap() -> None:
    ep, rp = tcp_pair()
    pub = ZmqEventPublisher(endpoint=ep, replay_endpoint=rp)
    try:
        for i in range(30):
            pub.publish(make_batch(i))
        sub = KVEventSubscriber(ep, rp, start_seq=0)
        time.sleep(SETTLE_S)
        pub.publish(make_batch(30))
        items = drain(sub)
        assert seqs(items) == list(range(31))
        sub.close()
    finally:
        pub.shutdown()


def rebind(ep: str, rp: str) -> ZmqEventPublisher:
    """A new publisher on the addresses of one just shut down in this process: libzmq releases
    a closed socket's port asynchronously, so retry briefly (a restarted process has no race)."""
    deadline = time.monotonic() + 5
    while True:
        try:
            return ZmqEventPublisher(endpoint=ep, replay_endpoint=rp)
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_publisher_restart_is_reported_then_new_stream_read_from_zero() -> None:
    ep, rp = tcp_pair()
    pub = ZmqEventPublisher(endpoint=ep, replay_endpoint=rp)
    sub = KVEventSubscriber(ep, rp)
    time.sleep(SETTLE_S)
    try:
        for i in range(5):
            pub.publish(make_batch(i))
        first = drain(sub)
        assert seqs(first) == [0, 1, 2, 3, 4]
        pub.shutdown()
        pub = rebind(ep, rp)
        # Publish until the reconnected subscriber sees something.
        items: list[SubscriberItem] = []
        n = 0
        deadline = time.monotonic() + 10
        while not items and time.monotonic() < deadline:
            pub.publish(make_batch(100 + n))
            n += 1
            items = drain(sub, idle=0.1)
        items += drain(sub, idle=0.3)
        restarted = items[0]
        assert isinstance(restarted, PublisherRestarted)
        assert restarted.last_seq == 4 and restarted.stream == StreamId(ep, "", 0)
        assert seqs(items[1:]) == list(range(n))  # the new stream from 0, replayed as needed
        assert [batch_id(i.batch) for i in items[1:] if isinstance(i, ReceivedBatch)] == [
            100 + k for k in range(n)
        ]
    finally:
        sub.close()
        pub.shutdown()


def test_follows_several_publishers_keeping_order_per_publisher() -> None:
    ep, rp = tcp_pair()
    pubs = [
        ZmqEventPublisher(data_parallel_rank=r, endpoint=ep, replay_endpoint=rp) for r in (0, 1)
    ]
    sub = KVEventSubscriber([p.endpoint for p in pubs], [p.replay_endpoint for p in pubs])
    time.sleep(SETTLE_S)
    try:
        for i in range(40):
            pubs[i % 2].publish(make_batch(i))
        items = drain(sub)
        by_rank: dict[int | None, list[int]] = {0: [], 1: []}
        for it in items:
            assert isinstance(it, ReceivedBatch)
            by_rank[it.batch.data_parallel_rank].append(it.seq)
            assert it.stream.endpoint == pubs[it.batch.data_parallel_rank or 0].endpoint
        assert by_rank == {0: list(range(20)), 1: list(range(20))}
    finally:
        sub.close()
        for p in pubs:
            p.shutdown()


def test_bind_layout_publishers_connect_and_replay_by_rank() -> None:
    ep, rp = tcp_pair()
    port = int(rp.rsplit(":", 1)[1])
    replays = {0: f"tcp://127.0.0.1:{port}", 1: f"tcp://127.0.0.1:{port + 1}"}
    sub = KVEventSubscriber(ep, replays, bind=True)
    StalledPublisher.release.clear()
    pubs = [
        StalledPublisher(
            data_parallel_rank=r, endpoint=ep, replay_endpoint=rp, bind=False, max_queue_size=2
        )
        for r in (0, 1)
    ]
    assert pubs[1].endpoint == ep  # connecting publishers keep the collector's address
    assert pubs[1].replay_endpoint == replays[1]
    # A bound SUB learns of new peers (and sends them its subscription) only while it is
    # being polled, so poll instead of sleeping.
    assert sub.recv(timeout=SETTLE_S) is None
    try:
        for i in range(6):
            for p in pubs:
                p.publish(make_batch(i))
        StalledPublisher.release.set()
        time.sleep(SETTLE_S)
        for p in pubs:
            p.publish(make_batch(6))
        items = drain(sub)
        per_rank = {
            r: [
                i.seq
                for i in items
                if isinstance(i, ReceivedBatch) and i.batch.data_parallel_rank == r
            ]
            for r in (0, 1)
        }
        assert per_rank == {0: list(range(7)), 1: list(range(7))}
        assert sub.num_gaps_repaired == 2
    finally:
        StalledPublisher.release.set()
        sub.close()
        for p in pubs:
            p.shutdown()


def test_reads_v1_replay_answers_of_older_vllm() -> None:
    """An older vLLM publisher answers replays without the topic frame."""
    ep, rp = tcp_pair()
    ctx: zmq.Context[Any] = zmq.Context.instance()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub.bind(ep)
    router.bind(rp)
    payloads = [encode_batch(make_batch(i)) for i in range(5)]
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if router.poll(50):
                ident, _, start = router.recv_multipart()
                for s in range(int.from_bytes(start, "big"), 5):
                    router.send_multipart([ident, b"", s.to_bytes(8, "big"), payloads[s]])
                router.send_multipart([ident, b"", END_SEQ, b""])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    sub = KVEventSubscriber(ep, rp, start_seq=0)
    time.sleep(SETTLE_S)
    try:
        pub.send_multipart([b"", (4).to_bytes(8, "big"), payloads[4]])
        assert seqs(drain(sub)) == [0, 1, 2, 3, 4]
    finally:
        stop.set()
        t.join()
        sub.close()
        pub.close(linger=0)
        router.close(linger=0)


def test_garbage_frames_are_counted_and_skipped() -> None:
    ep, _ = tcp_pair()
    ctx: zmq.Context[Any] = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.bind(ep)
    sub = KVEventSubscriber(ep)
    time.sleep(SETTLE_S)
    try:
        pub.send_multipart([b"only one frame"])
        pub.send_multipart([b"", b"short", b"x"])
        pub.send_multipart([b"", (0).to_bytes(8, "big"), b"\xc1not msgpack"])
        pub.send_multipart([b"", (1).to_bytes(8, "big"), encode_batch(make_batch(1))])
        items = drain(sub)
        assert seqs(items) == [1]
        assert sub.num_bad_frames == 2 and sub.num_decode_errors == 1
    finally:
        sub.close()
        pub.close(linger=0)


@pytest.fixture(scope="module")
def fuzz_target() -> Any:
    ep, rp = tcp_pair()
    ctx: zmq.Context[Any] = zmq.Context.instance()
    raw = ctx.socket(zmq.PUB)
    raw.bind(ep)
    publisher = ZmqEventPublisher(
        endpoint=f"tcp://127.0.0.1:{int(rp.rsplit(':', 1)[1]) + 1}", replay_endpoint=rp
    )
    sub = KVEventSubscriber(ep)
    time.sleep(SETTLE_S)
    yield raw, sub, publisher, rp
    sub.close()
    raw.close(linger=0)
    publisher.shutdown()


PROBE_IDS = itertools.count()
frame_lists = st.lists(st.binary(max_size=40), min_size=1, max_size=5)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(frames=frame_lists)
def test_fuzz_random_frames_never_end_the_subscriber(fuzz_target: Any, frames: list[bytes]) -> None:
    raw, sub, _, _ = fuzz_target
    raw.send_multipart(frames)
    while sub.recv(timeout=0.02) is not None:
        pass
    # Still alive: a well-formed batch on a fresh stream topic comes through.
    topic = f"probe{next(PROBE_IDS)}".encode()
    raw.send_multipart([topic, (0).to_bytes(8, "big"), encode_batch(make_batch(7))])
    got = sub.recv(timeout=2.0)
    while isinstance(got, ReceivedBatch) and got.stream.topic != topic.decode():
        got = sub.recv(timeout=2.0)
    assert isinstance(got, ReceivedBatch) and batch_id(got.batch) == 7


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(frames=frame_lists)
def test_fuzz_random_replay_requests_get_answers_and_socket_survives(
    fuzz_target: Any, frames: list[bytes]
) -> None:
    _, _, publisher, rp = fuzz_target
    if publisher.num_published == 0:
        publisher.publish(make_batch(0))
    answers = replay_request(rp, frames)
    assert answers[-1][-1] == b""
    good = replay_request(rp, [b"", bytes(8)])
    assert len(good) == publisher.num_published + 1


def read_json_lines(proc: subprocess.Popen[str], until_seq: int | None) -> list[int]:
    seen = []
    assert proc.stdout is not None
    for line in proc.stdout:
        record = json.loads(line)
        assert "seq" in record, f"unexpected marker {record}"
        seen.append(record["seq"])
        if until_seq is not None and record["seq"] >= until_seq:
            break
    return seen


@pytest.mark.slow
def test_subscriber_process_killed_and_restarted_sees_every_batch_in_order() -> None:
    ep, rp = tcp_pair()
    pub = ZmqEventPublisher(endpoint=ep, replay_endpoint=rp, topic="kv")
    total = 400
    stop = threading.Event()

    def feed() -> None:
        for i in range(total):
            if stop.is_set():
                return
            pub.publish(make_batch(i))
            time.sleep(0.005)

    def tail(from_seq: int) -> subprocess.Popen[str]:
        cmd = [
            sys.executable,
            "-m",
            "kvconnect.cli",
            "events",
            "tail",
            "--endpoint",
            ep,
            "--replay",
            rp,
            "--topic",
            "kv",
            "--json",
            "--from-seq",
            str(from_seq),
        ]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)

    first = tail(0)
    feeder = threading.Thread(target=feed, daemon=True)
    try:
        time.sleep(1.0)  # let the first subscriber start
        feeder.start()
        seen = read_json_lines(first, until_seq=120)
        first.kill()  # SIGKILL mid-stream
        first.wait()
        second = tail(seen[-1] + 1)
        try:
            feeder.join(timeout=30)
            pub.publish(make_batch(total))  # a final live batch the second process must see
            seen += read_json_lines(second, until_seq=total)
        finally:
            second.send_signal(signal.SIGINT)
            assert second.wait(timeout=10) == 0  # Ctrl-C ends the CLI cleanly
        assert seen == list(range(total + 1))
    finally:
        stop.set()
        for p in (first,):
            if p.poll() is None:
                p.kill()
        pub.shutdown()


def test_argument_errors() -> None:
    with pytest.raises(ValueError, match="one per endpoint"):
        KVEventSubscriber(["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"], "tcp://127.0.0.1:3")
    with pytest.raises(ValueError, match="2 given for 1"):
        KVEventSubscriber("tcp://127.0.0.1:1", ["tcp://127.0.0.1:3", None])
    with pytest.raises(ValueError, match="start_seq"):
        KVEventSubscriber("tcp://127.0.0.1:1", start_seq=-1)
    with pytest.raises(ValueError, match="cannot connect"):
        KVEventSubscriber("tcp://nohost")


def test_close_ends_iteration() -> None:
    ep, _ = tcp_pair()
    sub = KVEventSubscriber(ep)
    threading.Timer(0.2, sub.close).start()
    assert list(sub) == []


def test_stalled_subscriber_gets_every_batch_once_through_replay_after_resuming() -> None:
    ep, rp = tcp_pair()
    total = 3000
    pub = ZmqEventPublisher(endpoint=ep, replay_endpoint=rp, hwm=10, buffer_steps=total + 10)
    sub = KVEventSubscriber(ep, rp, hwm=10)
    time.sleep(SETTLE_S)
    try:
        for i in range(total):  # nobody reads: ZMQ drops live messages past the HWMs
            pub.publish(make_batch(i, num_events=4))
        # The stalled reader never held up publish(): nothing was dropped from its queue.
        assert pub.num_published == total and pub.num_dropped == 0
        items = drain(sub)  # the subscriber resumes: it reads what ZMQ kept
        pub.publish(make_batch(total))  # a live batch after the stall reveals the gap
        items += drain(sub)
        assert seqs(items) == list(range(total + 1))
        assert [batch_id(i.batch) for i in items if isinstance(i, ReceivedBatch)] == list(
            range(total + 1)
        )
        assert sub.num_gaps_repaired >= 1 and sub.num_batches_replayed > 0
        assert not [i for i in items if isinstance(i, EventsLost)]
    finally:
        sub.close()
        pub.shutdown()
