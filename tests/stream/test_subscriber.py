import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvconnect.events import encode_batch
from kvconnect.stream.publisher import END_SEQ, ZmqEventPublisher
from kvconnect.stream.subscriber import (
    EventsLost,
    KVEventSubscriber,
    PublisherRestarted,
    ReceivedBatch,
    StreamId,
    SubscriberItem,
)
from tests.helpers import (
    batch_id,
    bound_xpub,
    make_batch,
    poll_until,
    rebind,
    replay_request,
    take,
    tcp_pair,
    wait_subscribed,
)
from tests.stream.test_publisher import StalledPublisher


def seqs(items: list[SubscriberItem]) -> list[int]:
    return [i.seq for i in items if isinstance(i, ReceivedBatch)]


def test_yields_seq_and_batch_in_order() -> None:
    ep, rp = tcp_pair()
    pub = ZmqEventPublisher.open(bind=True, endpoint=ep, replay_endpoint=rp, topic="kv")
    sub = KVEventSubscriber(ep, rp, topic="kv")
    assert pub.wait_for_subscriber()
    try:
        for i in range(20):
            pub.publish(make_batch(i, num_events=3))
        items = take(sub, 20)
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
    pub = StalledPublisher.open(bind=True, endpoint=ep, replay_endpoint=rp, max_queue_size=3)
    sub = KVEventSubscriber(ep, rp)
    assert pub.wait_for_subscriber()
    try:
        for i in range(10):  # 0..2 queued live, 3..9 dropped from the live path
            pub.publish(make_batch(i))
        StalledPublisher.release.set()
        assert pub.flush()  # the live queue has room again
        pub.publish(make_batch(10))  # live 10 after live 2: the gap 3..9 is fetched first
        items = take(sub, 11)
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
    pub = StalledPublisher.open(
        bind=True, endpoint=ep, replay_endpoint=rp, max_queue_size=2, buffer_steps=5
    )
    sub = KVEventSubscriber(ep, rp)
    assert pub.wait_for_subscriber()
    try:
        for i in range(20):  # live: 0, 1; the ring then holds 15..19
            pub.publish(make_batch(i))
        StalledPublisher.release.set()
        assert pub.flush()
        pub.publish(make_batch(20))  # ring now 16..20
        items = take(sub, 7)
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
    pub = StalledPublisher.open(bind=True, endpoint=ep, max_queue_size=1)
    sub = KVEventSubscriber(ep)
    assert pub.wait_for_subscriber()
    try:
        for i in range(4):
            pub.publish(make_batch(i))
        StalledPublisher.release.set()
        assert pub.flush()
        pub.publish(make_batch(4))
        items = take(sub, 2)
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
    pub = ZmqEventPublisher.open(bind=True, endpoint=ep, replay_endpoint=rp)
    try:
        for i in range(30):
            pub.publish(make_batch(i))
        sub = KVEventSubscriber(ep, rp, start_seq=0)
        assert pub.wait_for_subscriber()
        pub.publish(make_batch(30))
        items = take(sub, 31)
        assert seqs(items) == list(range(31))  # each once, though some came twice
        sub.close()
    finally:
        pub.shutdown()


def test_a_late_subscriber_catches_up_on_an_idle_stream_at_connect() -> None:
    ep, rp = tcp_pair()
    pub = ZmqEventPublisher.open(bind=True, endpoint=ep, replay_endpoint=rp)
    try:
        for i in range(500):
            pub.publish(make_batch(i))
        # No batch is published after the subscriber joins: the handshake alone catches up.
        with KVEventSubscriber(ep, rp, start_seq=0) as sub:
            items = take(sub, 500)
            assert seqs(items) == list(range(500)) and sub.num_handshakes == 1
    finally:
        pub.shutdown()


def test_live_batches_that_the_handshake_already_replayed_are_dropped_once() -> None:
    ep, rp = tcp_pair()
    pub = ZmqEventPublisher.open(bind=True, endpoint=ep, replay_endpoint=rp)
    try:
        sub = KVEventSubscriber(ep, rp, start_seq=0)
        assert pub.wait_for_subscriber()
        for i in range(50):  # live to the subscriber, and in the ring its handshake reads
            pub.publish(make_batch(i))
        items = take(sub, 50)
        assert seqs(items) == list(range(50))
        # The handshake (handled before the queued live batches) replayed all 50 from the
        # ring; their live copies came after and were dropped.
        assert sub.num_batches_replayed == 50 and sub.num_duplicates == 50
        sub.close()
    finally:
        pub.shutdown()


def test_publisher_restart_is_reported_then_new_stream_read_from_zero() -> None:
    ep, rp = tcp_pair()
    pub = ZmqEventPublisher.open(bind=True, endpoint=ep, replay_endpoint=rp)
    sub = KVEventSubscriber(ep, rp)
    assert pub.wait_for_subscriber()
    try:
        for i in range(5):
            pub.publish(make_batch(i))
        first = take(sub, 5)
        assert seqs(first) == [0, 1, 2, 3, 4]
        pub.shutdown()
        pub = rebind(ep, rp)
        new = pub
        items = poll_until(sub, lambda: new.num_subscriptions > 0)  # it reconnects by itself
        for k in range(3):
            pub.publish(make_batch(100 + k))
        items += take(sub, 3)
        restarted = items[0]
        assert isinstance(restarted, PublisherRestarted)
        assert restarted.last_seq == 4 and restarted.stream == StreamId(ep, "", 0)
        assert seqs(items[1:]) == [0, 1, 2]  # the new stream from 0, replayed as needed
        assert [batch_id(i.batch) for i in items[1:] if isinstance(i, ReceivedBatch)] == [
            100,
            101,
            102,
        ]
    finally:
        sub.close()
        pub.shutdown()


@pytest.mark.parametrize("new_publishes", [0, 50, 99, 100, 101, 200])
def test_a_restart_behind_a_disconnect_is_seen_whatever_the_new_seqs(new_publishes: int) -> None:
    """A publishes 0..99 and stops; B, on the same addresses, publishes 0..N-1 before the
    subscriber is back. N below 100 goes back, N=100 continues A's seqs exactly, N above
    passes them: in no case may B's batches be read as A's continuation."""
    ep, rp = tcp_pair()
    a = ZmqEventPublisher.open(bind=True, endpoint=ep, replay_endpoint=rp)
    sub = KVEventSubscriber(ep, rp)
    assert a.wait_for_subscriber()
    b = None
    try:
        for i in range(100):
            a.publish(make_batch(i))
        assert seqs(take(sub, 100)) == list(range(100))
        a.shutdown()
        b = rebind(ep, rp)
        for i in range(new_publishes):
            b.publish(make_batch(1000 + i))
        new = b
        items = poll_until(sub, lambda: new.num_subscriptions > 0)
        b.publish(make_batch(1000 + new_publishes))  # the next live batch
        items += take(sub, new_publishes + 1 - sum(isinstance(i, ReceivedBatch) for i in items))
        assert items[0] == PublisherRestarted(StreamId(ep, "", 0), 99, 0)
        assert seqs(items[1:]) == list(range(new_publishes + 1))
        assert [batch_id(i.batch) for i in items[1:] if isinstance(i, ReceivedBatch)] == [
            1000 + k for k in range(new_publishes + 1)
        ]
    finally:
        sub.close()
        a.shutdown()
        if b is not None:
            b.shutdown()


def test_a_vllm_publisher_restart_is_seen_by_its_seq_going_back() -> None:
    """vLLM's publisher has no epoch: its restart shows only as seq starting over."""
    with tempfile.TemporaryDirectory() as d:
        ep = f"ipc://{d}/ev"
        sub = KVEventSubscriber(ep)
        first = bound_xpub(ep)
        wait_subscribed(first)
        for i in range(5):
            first.send_multipart([b"", i.to_bytes(8, "big"), encode_batch(make_batch(i))])
        assert seqs(take(sub, 5)) == list(range(5))
        first.close(linger=0)
        second = bound_xpub(ep)
        poll_until(sub, lambda: bool(second.poll(0)))
        wait_subscribed(second)
        for i in range(2):
            second.send_multipart([b"", i.to_bytes(8, "big"), encode_batch(make_batch(50 + i))])
        items = take(sub, 2)
        assert items[0] == PublisherRestarted(StreamId(ep, "", None), 4, 0)
        assert seqs(items[1:]) == [0, 1]
        sub.close()
        second.close(linger=0)


def test_follows_several_publishers_keeping_order_per_publisher() -> None:
    ep, rp = tcp_pair()
    pubs = [
        ZmqEventPublisher.open(bind=True, data_parallel_rank=r, endpoint=ep, replay_endpoint=rp)
        for r in (0, 1)
    ]
    sub = KVEventSubscriber([p.endpoint for p in pubs], [p.replay_endpoint for p in pubs])
    assert all(p.wait_for_subscriber() for p in pubs)
    try:
        for i in range(40):
            pubs[i % 2].publish(make_batch(i))
        items = take(sub, 40)
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
    """llm-d's collector layout: the subscriber binds, each DP rank's publisher connects to
    the collector's port + its rank (vLLM offsets connecting endpoints too)."""
    ep, rp = tcp_pair()
    port, replay_port = int(ep.rsplit(":", 1)[1]), int(rp.rsplit(":", 1)[1])
    collector = [ep, f"tcp://127.0.0.1:{port + 1}"]
    replays = {0: rp, 1: f"tcp://127.0.0.1:{replay_port + 1}"}
    sub = KVEventSubscriber(collector, replays, bind=True)
    StalledPublisher.release.clear()
    pubs = [
        StalledPublisher.open(
            data_parallel_rank=r, endpoint=ep, replay_endpoint=rp, bind=False, max_queue_size=2
        )
        for r in (0, 1)
    ]
    assert [p.endpoint for p in pubs] == collector
    assert pubs[1].replay_endpoint == replays[1]
    # A bound SUB learns of new peers (and sends them its subscription) only while it is
    # being polled: poll it until both publishers have its subscription.
    deadline = time.monotonic() + 10
    while not all(p.num_subscriptions for p in pubs):
        assert sub.recv(timeout=0.05) is None and time.monotonic() < deadline
    try:
        for i in range(6):
            for p in pubs:
                p.publish(make_batch(i))
        StalledPublisher.release.set()
        assert all(p.flush() for p in pubs)
        for p in pubs:
            p.publish(make_batch(6))
        items = take(sub, 14)
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
    pub, router = bound_xpub(ep), ctx.socket(zmq.ROUTER)
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
    wait_subscribed(pub)
    try:
        pub.send_multipart([b"", (4).to_bytes(8, "big"), payloads[4]])
        assert seqs(take(sub, 5)) == [0, 1, 2, 3, 4]
    finally:
        stop.set()
        t.join()
        sub.close()
        pub.close(linger=0)
        router.close(linger=0)


def test_garbage_frames_are_counted_and_skipped() -> None:
    ep, _ = tcp_pair()
    pub = bound_xpub(ep)
    sub = KVEventSubscriber(ep)
    wait_subscribed(pub)
    try:
        pub.send_multipart([b"only one frame"])
        pub.send_multipart([b"", b"short", b"x"])
        pub.send_multipart([b"", (0).to_bytes(8, "big"), b"\xc1not msgpack"])
        pub.send_multipart([b"", (1).to_bytes(8, "big"), encode_batch(make_batch(1))])
        items = take(sub, 1)
        assert seqs(items) == [1]
        assert sub.num_bad_frames == 2 and sub.num_decode_errors == 1
    finally:
        sub.close()
        pub.close(linger=0)


@pytest.fixture(scope="module")
def fuzz_target() -> Any:
    ep, rp = tcp_pair()
    raw = bound_xpub(ep)
    publisher = ZmqEventPublisher.open(
        endpoint=f"tcp://127.0.0.1:{int(rp.rsplit(':', 1)[1]) + 1}", replay_endpoint=rp, bind=True
    )
    sub = KVEventSubscriber(ep)
    wait_subscribed(raw)
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
    pub = ZmqEventPublisher.open(bind=True, endpoint=ep, replay_endpoint=rp, topic="kv")
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
        assert pub.wait_for_subscriber(timeout=30)  # the first subscriber process is up
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
            assert second.wait(timeout=60) == 0  # Ctrl-C ends the CLI cleanly
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


def test_close_from_another_thread_closes_each_descriptor_once() -> None:
    # close() while the reader is between polls closes the sockets at once; the reader, back
    # in recv(), must not close them again: the pipe's numbers may already be another's (a
    # fresh socket of the next publisher, in vLLM 0.33's suite: its stream never came up).
    ep, _ = tcp_pair()
    sub = KVEventSubscriber(ep)
    sub.close()  # no reader polling: closed here
    r, w = os.pipe()  # the lowest free numbers: most likely the subscriber's old pipe's
    try:
        assert sub.recv(timeout=0) is None  # the reader's next turn
        os.fstat(r), os.fstat(w)  # both still open
        os.write(w, b"x")
        assert os.read(r, 1) == b"x"
    finally:
        os.close(r)
        os.close(w)


def test_close_while_batches_arrive_closes_every_socket() -> None:
    # close() during the reader's poll leaves the sockets to the reader. One that returned a
    # batch taken in that poll instead ended the iteration with its monitor open and unread:
    # libzmq's I/O thread sends monitor events blocking, so the next one stalled every
    # socket of the shared context (vLLM 0.33's suite: the next test's publisher never came
    # up).
    ep, _ = tcp_pair()
    pub = ZmqEventPublisher.open(bind=True, endpoint=ep)
    stop = threading.Event()

    def flood() -> None:
        i = 0
        while not stop.is_set():
            pub.publish(make_batch(i))
            i += 1
            if i % 50 == 0:
                time.sleep(0.0005)

    def read_all(sub: KVEventSubscriber, got: threading.Event) -> None:
        for _ in sub:
            got.set()

    threading.Thread(target=flood, daemon=True).start()
    try:
        for _ in range(20):
            sub = KVEventSubscriber(ep)
            sockets = [s for src in sub._sources for s in (src.sub, src.monitor) if s]
            got = threading.Event()
            reader = threading.Thread(target=read_all, args=(sub, got), daemon=True)
            reader.start()
            assert got.wait(10)
            sub.close()
            reader.join(10)
            assert not reader.is_alive()
            assert all(s.closed for s in sockets), "the iteration ended with sockets open"
    finally:
        stop.set()
        pub.shutdown()


def test_stalled_subscriber_gets_every_batch_once_through_replay_after_resuming(
    tmp_path: Path,
) -> None:
    # ipc: a unix socket buffers far less than loopback TCP, so the stall really drops.
    ep, rp = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay"
    total = 3000
    pub = ZmqEventPublisher.open(
        bind=True, endpoint=ep, replay_endpoint=rp, hwm=10, buffer_steps=total + 10
    )
    sub = KVEventSubscriber(ep, rp, hwm=10)
    assert pub.wait_for_subscriber()
    try:
        for i in range(total):  # nobody reads: ZMQ drops live messages past the HWMs
            pub.publish(make_batch(i, num_events=40))  # ~3 KB each: more than socket buffers
        # The stalled reader never held up publish(): nothing was dropped from its queue.
        assert pub.num_published == total and pub.num_dropped == 0
        assert pub.flush()  # every batch went to the socket, which dropped what did not fit
        # The subscriber resumes: it reads what ZMQ kept (everything queued is local, so a
        # quiet 0.3 s means the queues are empty)...
        kept: list[SubscriberItem] = []
        while (item := sub.recv(timeout=0.3)) is not None:
            kept.append(item)
        assert 0 < len(kept) < total
        pub.publish(make_batch(total))  # ...then a live batch after the stall reveals the gap
        items = kept + take(sub, total + 1 - len(kept))
        assert seqs(items) == list(range(total + 1))
        assert [batch_id(i.batch) for i in items if isinstance(i, ReceivedBatch)] == list(
            range(total + 1)
        )
        assert sub.num_gaps_repaired >= 1 and sub.num_batches_replayed > 0
        assert not [i for i in items if isinstance(i, EventsLost)]
    finally:
        sub.close()
        pub.shutdown()


@pytest.mark.parametrize("first_part", [5, 0])
def test_a_replay_answer_that_stalls_midway_is_asked_again_from_where_it_stopped(
    first_part: int,
) -> None:
    """The replay deadline is on progress: a publisher that sends half an answer, or nothing
    (busy with a flood of other sessions), and goes quiet is asked again from the next seq;
    nothing is reported lost (a router that hears "lost" clears that instance's index)."""
    ep, rp = tcp_pair()
    ctx: zmq.Context[Any] = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.bind(rp)
    payloads = [encode_batch(make_batch(i)) for i in range(10)]
    requests: list[int] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if router.poll(50):
                ident, _, start = router.recv_multipart()
                first = int.from_bytes(start, "big")
                requests.append(first)
                for s in range(first, first_part if len(requests) == 1 else 10):
                    router.send_multipart([ident, b"", b"", s.to_bytes(8, "big"), payloads[s]])
                if len(requests) > 1:  # the first answer stops early with no terminator
                    router.send_multipart([ident, b"", b"", END_SEQ, b""])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    pub = bound_xpub(ep)
    sub = KVEventSubscriber(ep, rp, start_seq=0, replay_timeout=0.3)
    try:
        wait_subscribed(pub)
        items = take(sub, 10)
        assert seqs(items) == list(range(10)) and len(items) == 10
        assert requests == [0, first_part]
        assert sub.num_replay_failures == 1 and sub.num_batches_lost == 0
    finally:
        stop.set()
        t.join()
        sub.close()
        pub.close(linger=0)
        router.close(linger=0)
