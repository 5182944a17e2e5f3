import dataclasses
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from queue import Empty
from typing import Any

import msgspec
import pytest
import zmq

from kvconnect.config import KVEventsConfig
from kvconnect.events import KVEventBatch, decode_batch
from kvconnect.stream.publisher import (
    END_SEQ,
    EventPublisher,
    EventPublisherFactory,
    NullEventPublisher,
    PublisherStatus,
    ZmqEventPublisher,
    offset_endpoint,
)
from tests.helpers import batch_id, make_batch, rebind, recv_frames, replay_request, tcp_pair


def terminator(pub: ZmqEventPublisher) -> list[bytes]:
    """The last answer of a replay: the publisher's status, then vLLM's END_SEQ and b""."""
    return [pub.status().encode(), END_SEQ, b""]


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    c: zmq.Context[Any] = zmq.Context.instance()
    yield c


def raw_sub(ctx: zmq.Context[Any], pub: ZmqEventPublisher, topic: bytes = b"") -> zmq.Socket[bytes]:
    """A plain SUB socket on `pub`, returned once `pub` has its subscription."""
    before = pub.num_subscriptions
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(pub.endpoint)
    assert pub.wait_for_subscriber(num_subscriptions=before + 1), "no subscription arrived"
    return sub


def seq_of(frames: list[bytes]) -> int:
    return int.from_bytes(frames[-2], "big")


class _GatedQueue:
    """The publisher's queue, but nothing comes out of it until `gate` is set."""

    def __init__(self, inner: Any, gate: threading.Event) -> None:
        self.inner, self.gate = inner, gate

    def put(self, item: Any) -> None:
        self.inner.put(item)

    def get_nowait(self) -> Any:
        if not self.gate.is_set():
            raise Empty
        return self.inner.get_nowait()

    def get(self, timeout: float | None = None) -> Any:
        if not self.gate.wait(timeout):
            raise Empty
        return self.inner.get(timeout=timeout)


class StalledPublisher(ZmqEventPublisher):
    """A publisher whose sending thread sends nothing until `release` is set: a stuck live
    path (it still sees subscriptions, so tests can wait for them)."""

    release = threading.Event()

    def _send_now(self, seq_bytes: bytes, payload: bytes) -> bool:
        return self.release.is_set() and super()._send_now(seq_bytes, payload)

    def _send_loop(self) -> None:
        self._queue = _GatedQueue(self._queue, self.release)  # type: ignore[assignment]
        super()._send_loop()


def test_live_frames_are_exactly_topic_seq_payload(ctx: zmq.Context[Any]) -> None:
    ep, rp = tcp_pair()
    pub = ZmqEventPublisher.open(bind=True, endpoint=ep, replay_endpoint=rp, topic="kv@10.0.0.1@m")
    sub = raw_sub(ctx, pub)
    try:
        sent = [make_batch(i, num_events=3) for i in range(10)]
        for b in sent:
            pub.publish(b)
        for i in range(10):
            frames = recv_frames(sub)
            assert frames is not None
            assert len(frames) == 3
            assert frames[0] == b"kv@10.0.0.1@m"
            assert frames[1] == i.to_bytes(8, "big")
            batch = decode_batch(frames[2])
            # The rank is stamped on the wire, not in the caller's batch.
            assert sent[i].data_parallel_rank is None and batch.data_parallel_rank == 0
            assert batch == msgspec.structs.replace(sent[i], data_parallel_rank=0)
            assert abs(batch.ts - time.time()) < 5
        assert pub.num_published == 10 and pub.num_dropped == 0
    finally:
        sub.close()
        pub.shutdown()


def test_replay_from_middle_returns_exactly_the_later_batches(ctx: zmq.Context[Any]) -> None:
    ep, rp = tcp_pair()
    pub = ZmqEventPublisher.open(bind=True, endpoint=ep, replay_endpoint=rp, topic="test")
    try:
        payloads = []
        for i in range(19):
            b = make_batch(i)
            pub.publish(b)
            payloads.append(b)
        answers = replay_request(rp, [b"", (10).to_bytes(8, "big")])
        assert answers[-1] == terminator(pub)
        data = answers[:-1]
        assert [seq_of(a) for a in data] == list(range(10, 19))
        assert all(a[0] == b"test" and len(a) == 3 for a in data)
        assert [batch_id(decode_batch(a[2])) for a in data] == list(range(10, 19))
        # Beyond the newest: just the terminator.
        assert replay_request(rp, [b"", (19).to_bytes(8, "big")]) == [terminator(pub)]
    finally:
        pub.shutdown()


def test_replay_ring_keeps_the_last_buffer_steps() -> None:
    ep, rp = tcp_pair()
    pub = ZmqEventPublisher.open(bind=True, endpoint=ep, replay_endpoint=rp, buffer_steps=100)
    try:
        for i in range(110):
            pub.publish(make_batch(i))
        answers = replay_request(rp, [b"", (0).to_bytes(8, "big")])
        assert [seq_of(a) for a in answers[:-1]] == list(range(10, 110))
    finally:
        pub.shutdown()


def test_replay_answers_a_req_client(ctx: zmq.Context[Any]) -> None:
    ep, rp = tcp_pair()
    pub = ZmqEventPublisher.open(bind=True, endpoint=ep, replay_endpoint=rp, topic="t")
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(rp)
    try:
        pub.publish(make_batch(0))
        req.send((0).to_bytes(8, "big"))
        frames = recv_frames(req)
        assert frames is not None and frames[0] == b"t" and seq_of(frames) == 0
    finally:
        req.close()
        pub.shutdown()


@pytest.mark.parametrize(
    "frames",
    [
        [b"", b"\x00\x01"],  # seq too short
        [b"", (0).to_bytes(8, "big"), b"extra"],  # too many frames
        [(0).to_bytes(8, "big")],  # DEALER without the empty delimiter
        [b"x", (0).to_bytes(8, "big")],  # delimiter not empty
    ],
)
def test_malformed_replay_requests_get_the_terminator(frames: list[bytes]) -> None:
    ep, rp = tcp_pair()
    pub = ZmqEventPublisher.open(bind=True, endpoint=ep, replay_endpoint=rp)
    try:
        pub.publish(make_batch(0))
        assert replay_request(rp, frames) == [terminator(pub)]
        # And the socket still serves good requests afterwards.
        answers = replay_request(rp, [b"", (0).to_bytes(8, "big")])
        assert [seq_of(a) for a in answers[:-1]] == [0]
    finally:
        pub.shutdown()


def test_topic_filtering(ctx: zmq.Context[Any]) -> None:
    ep, _ = tcp_pair()
    pub = ZmqEventPublisher.open(bind=True, endpoint=ep, topic="foo")
    foo, bar = raw_sub(ctx, pub, b"foo"), raw_sub(ctx, pub, b"bar")
    try:
        for i in range(3):
            pub.publish(make_batch(i))
        assert [seq_of(recv_frames(foo) or []) for _ in range(3)] == [0, 1, 2]
        assert recv_frames(bar, timeout=0.3) is None
    finally:
        foo.close()
        bar.close()
        pub.shutdown()


def test_dp_rank_offsets_tcp_ports(ctx: zmq.Context[Any]) -> None:
    ep, rp = tcp_pair()
    base_port = int(ep.rsplit(":", 1)[1])
    pub1 = ZmqEventPublisher.open(bind=True, data_parallel_rank=1, endpoint=ep, replay_endpoint=rp)
    assert pub1.endpoint == f"tcp://127.0.0.1:{base_port + 1}"
    assert pub1.replay_endpoint == f"tcp://127.0.0.1:{base_port + 3}"
    sub = raw_sub(ctx, pub1)
    try:
        pub1.publish(make_batch(0, num_events=2))
        frames = recv_frames(sub)
        assert frames is not None and decode_batch(frames[2]).data_parallel_rank == 1
        answers = replay_request(pub1.replay_endpoint, [b"", bytes(8)])
        assert len(answers) == 2
    finally:
        sub.close()
        pub1.shutdown()


def test_dp_rank_offsets_ipc_paths(ctx: zmq.Context[Any]) -> None:
    with tempfile.TemporaryDirectory() as d:
        ep, rp = f"ipc://{d}/kv", f"ipc://{d}/kv-replay"
        pub1 = ZmqEventPublisher.open(
            bind=True, data_parallel_rank=1, endpoint=ep, replay_endpoint=rp
        )
        assert pub1.endpoint == f"ipc://{d}/kv_dp1"
        assert os.path.exists(f"{d}/kv_dp1") and os.path.exists(f"{d}/kv-replay_dp1")
        sub = raw_sub(ctx, pub1)
        try:
            pub1.publish(make_batch(0))
            frames = recv_frames(sub)
            assert frames is not None and decode_batch(frames[2]).data_parallel_rank == 1
        finally:
            sub.close()
            pub1.shutdown()


def test_inproc_transport(ctx: zmq.Context[Any]) -> None:
    pub = ZmqEventPublisher.open(
        bind=True, endpoint="inproc://kv-test", replay_endpoint="inproc://kv-test-r"
    )
    sub = raw_sub(ctx, pub)
    try:
        pub.publish(make_batch(4))
        frames = recv_frames(sub)
        assert frames is not None and batch_id(decode_batch(frames[2])) == 4
        assert len(replay_request("inproc://kv-test-r", [b"", bytes(8)])) == 2
    finally:
        sub.close()
        pub.shutdown()


def test_endpoint_rules_are_vllms_with_a_loopback_default() -> None:
    def binds(endpoint: str | None, bind: bool | None = None) -> bool:
        return KVEventsConfig(endpoint=endpoint, bind=bind).binds_endpoint  # type: ignore[arg-type]

    assert binds("tcp://*:5557") and binds("tcp://[::]:1") and binds("tcp://[::1]:1")
    assert binds("ipc:///tmp/x") and binds("inproc://x")
    # vLLM connects to any other address: a collector that binds it.
    assert not binds("tcp://10.1.2.3:5557") and not binds("tcp://collector:5557")
    assert not binds("tcp://127.0.0.1:5557") and not binds("tcp://0.0.0.0:1")
    assert binds("tcp://127.0.0.1:5557", bind=True) and not binds("tcp://*:1", bind=False)
    assert binds(None) and KVEventsConfig().endpoint == "tcp://127.0.0.1:5557"  # the default
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:0", 3) == "tcp://*:0"  # the OS picks the port
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert offset_endpoint("ipc:///tmp/kv.sock", 2) == "ipc:///tmp/kv.sock_dp2"
    assert offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1"
    assert offset_endpoint(None, 1) is None
    with pytest.raises(ValueError, match="invalid endpoint"):
        offset_endpoint("udp://x:1", 1)


def test_bad_arguments_and_busy_port_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="buffer_steps"):
        ZmqEventPublisher.open(endpoint="tcp://127.0.0.1:5", buffer_steps=0)
    ep, _ = tcp_pair()
    first = ZmqEventPublisher.open(bind=True, endpoint=ep)
    try:
        with pytest.raises(RuntimeError, match="cannot open KV event sockets"):
            ZmqEventPublisher.open(bind=True, endpoint=ep)
    finally:
        first.shutdown()


def test_full_queue_drops_live_but_keeps_replayable_and_publish_never_waits(
    ctx: zmq.Context[Any],
) -> None:
    ep, rp = tcp_pair()
    StalledPublisher.release.clear()
    pub = StalledPublisher.open(bind=True, endpoint=ep, replay_endpoint=rp, max_queue_size=5)
    sub = raw_sub(ctx, pub)
    try:
        for i in range(50):  # the sending thread is stuck: publish() must still return
            pub.publish(make_batch(i))
        assert pub.num_published == 50 and pub.num_dropped == 45
        answers = replay_request(rp, [b"", bytes(8)])
        assert [seq_of(a) for a in answers[:-1]] == list(range(50))
        StalledPublisher.release.set()
        live = [seq_of(f) for f in iter(lambda: recv_frames(sub, 0.5), None)]
        assert live == [0, 1, 2, 3, 4]
        pub.publish(make_batch(50))
        assert seq_of(recv_frames(sub) or []) == 50
    finally:
        StalledPublisher.release.set()
        sub.close()
        pub.shutdown()


def test_shutdown_flushes_is_idempotent_and_publish_after_raises(
    ctx: zmq.Context[Any],
) -> None:
    ep, _ = tcp_pair()
    pub = ZmqEventPublisher.open(bind=True, endpoint=ep)
    sub = raw_sub(ctx, pub)
    try:
        for i in range(2000):
            pub.publish(make_batch(i, num_events=4))
        pub.shutdown(timeout=10)
        got = [seq_of(f) for f in iter(lambda: recv_frames(sub, 1.0), None)]
        assert got == list(range(2000))
        pub.shutdown()
        with pytest.raises(RuntimeError, match="after shutdown"):
            pub.publish(make_batch(0))
    finally:
        sub.close()


def test_shutdown_of_a_stuck_sender_returns_within_the_timeout() -> None:
    ep, _ = tcp_pair()
    StalledPublisher.release.clear()
    pub = StalledPublisher.open(bind=True, endpoint=ep)
    pub.publish(make_batch(0))
    start = time.monotonic()
    pub.shutdown(timeout=0.2)
    assert time.monotonic() - start < 2.0
    StalledPublisher.release.set()


def test_rank_already_set_is_kept() -> None:
    ep, rp = tcp_pair()
    pub = ZmqEventPublisher.open(bind=True, data_parallel_rank=2, endpoint=ep, replay_endpoint=rp)
    try:
        b = make_batch(0)
        b.data_parallel_rank = 5
        pub.publish(b)
        answers = replay_request(pub.replay_endpoint or "", [b"", bytes(8)])
        assert decode_batch(answers[0][2]).data_parallel_rank == 5
    finally:
        pub.shutdown()


def test_null_publisher() -> None:
    pub = NullEventPublisher()
    pub.publish(KVEventBatch(0.0, []))
    pub.shutdown()
    pub.shutdown()


def test_factory_builds_null_when_disabled() -> None:
    assert isinstance(EventPublisherFactory.create(None), NullEventPublisher)
    cfg = KVEventsConfig(enable_kv_cache_events=False, publisher="zmq")
    assert isinstance(EventPublisherFactory.create(cfg), NullEventPublisher)
    cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    assert isinstance(EventPublisherFactory.create(cfg), NullEventPublisher)


def test_factory_builds_zmq_with_rank_offsets_and_leaves_config_alone() -> None:
    ep, rp = tcp_pair()
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=ep, replay_endpoint=rp, topic="x")
    before = dataclasses.asdict(cfg)
    pub = EventPublisherFactory.create(cfg, data_parallel_rank=1)
    try:
        assert isinstance(pub, ZmqEventPublisher)
        assert pub.endpoint == offset_endpoint(ep, 1) and pub.replay_endpoint == offset_endpoint(
            rp, 1
        )
        assert pub.topic == "x"
        assert dataclasses.asdict(cfg) == before
    finally:
        pub.shutdown()


def test_factory_registry() -> None:
    class Recording(EventPublisher):
        def __init__(self, config: KVEventsConfig, data_parallel_rank: int) -> None:
            super().__init__(data_parallel_rank)
            self.config = config

        def publish(self, batch: KVEventBatch) -> None:
            pass

        def shutdown(self, timeout: float = 1.0) -> None:
            pass

    name = f"recording-{os.getpid()}-{time.monotonic_ns()}"
    EventPublisherFactory.register_publisher(name, Recording)
    with pytest.raises(ValueError, match="already registered"):
        EventPublisherFactory.register_publisher(name, Recording)
    pub = EventPublisherFactory.create(
        KVEventsConfig(enable_kv_cache_events=True, publisher=name, topic="t"), 3
    )
    assert isinstance(pub, Recording) and pub._data_parallel_rank == 3
    assert pub.config.topic == "t" and pub.config.publisher == name
    assert pub.num_published == 0 and pub.endpoint is None  # every publisher's counters
    with pytest.raises(ValueError, match=r"unknown event publisher 'nope'; known: .*null.*zmq"):
        EventPublisherFactory.create(KVEventsConfig(enable_kv_cache_events=True, publisher="nope"))


def test_each_publisher_has_its_own_epoch_in_the_replay_terminator() -> None:
    ep, rp = tcp_pair()
    pub = ZmqEventPublisher.open(bind=True, endpoint=ep, replay_endpoint=rp)
    try:
        for i in range(3):
            pub.publish(make_batch(i))
        # A start beyond the ring is the first-contact handshake: the terminator alone.
        (last,) = replay_request(rp, [b"", (2**64 - 1).to_bytes(8, "big")])
        # vLLM readers end on seq -1 and an empty last frame; the status rides in front.
        assert last[-2:] == [END_SEQ, b""]
        status = PublisherStatus.decode(last[0])
        assert status == PublisherStatus(pub.epoch, 3) and len(pub.epoch) == 16
    finally:
        pub.shutdown()
    other = rebind(ep, rp)
    other.shutdown()
    assert other.epoch != pub.epoch
    assert PublisherStatus.decode(b"") is None and PublisherStatus.decode(b"kvconnect x") is None


def test_subscriptions_are_counted_and_wait_for_subscriber_times_out(
    ctx: zmq.Context[Any],
) -> None:
    ep, _ = tcp_pair()
    pub = ZmqEventPublisher.open(bind=True, endpoint=ep)
    try:
        assert pub.num_subscriptions == 0 and not pub.wait_for_subscriber(timeout=0.2)
        sub = raw_sub(ctx, pub)
        assert pub.num_subscriptions == 1
        sub.close()
        with pub._subscriptions_changed:  # the peer's unsubscribe comes up when it leaves
            assert pub._subscriptions_changed.wait_for(lambda: pub.num_subscriptions == 0, 10)
    finally:
        pub.shutdown()


def test_a_dp_rank_connecting_to_a_collector_offsets_its_port_too(ctx: zmq.Context[Any]) -> None:
    ep, _ = tcp_pair()
    port = int(ep.rsplit(":", 1)[1])
    collector = ctx.socket(zmq.SUB)
    collector.setsockopt(zmq.LINGER, 0)
    collector.setsockopt(zmq.SUBSCRIBE, b"")
    collector.bind(f"tcp://127.0.0.1:{port + 1}")
    pub = ZmqEventPublisher.open(data_parallel_rank=1, endpoint=ep)  # 127.0.0.1: connect
    try:
        assert pub.endpoint == f"tcp://127.0.0.1:{port + 1}"
        deadline = time.monotonic() + 10
        while not pub.num_subscriptions:  # a bound SUB greets new peers while it is polled
            assert collector.poll(20) == 0 and time.monotonic() < deadline
        pub.publish(make_batch(3))
        frames = recv_frames(collector)
        assert frames is not None and decode_batch(frames[2]).data_parallel_rank == 1
    finally:
        collector.close()
        pub.shutdown()


def test_port_zero_binds_a_port_the_os_chooses(ctx: zmq.Context[Any]) -> None:
    pub = ZmqEventPublisher.open(
        endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", bind=True
    )
    try:
        assert not pub.endpoint.endswith(":0") and pub.replay_endpoint is not None
        assert not pub.replay_endpoint.endswith(":0")
        sub = raw_sub(ctx, pub)
        pub.publish(make_batch(1))
        assert seq_of(recv_frames(sub) or []) == 0
        assert len(replay_request(pub.replay_endpoint, [b"", bytes(8)])) == 2
        sub.close()
    finally:
        pub.shutdown()
