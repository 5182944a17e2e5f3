"""Event publishers: how the step owner's `KVEventBatch`es leave the process.

Contract:
- `publish(batch)` is called by the step owner (the scheduler), once per step with that step's
  events. It never blocks: the ZMQ publisher stamps the rank and the sequence number, encodes,
  stores the bytes in the replay ring and sends them itself (non-blocking) when nothing is
  queued and the socket is free, else queues them for the sending thread, then returns.
  When the queue is full the batch is not sent live (counted in `num_dropped`) but stays
  replayable, so a subscriber that sees the gap fetches it. Calling it after `shutdown()`
  raises `RuntimeError`.
- `shutdown(timeout)` sends what it can within `timeout` seconds, then closes; calling it
  again does nothing.

Wire: `wire.py` (vLLM's frames, plus kvconnect's status and snapshot request). Replays and
snapshots: `replay.py`, on the replay server's own thread, which also keeps the state the stream
describes (`state.StreamState`). vLLM's publisher reads a snapshot request as a replay from
beyond its ring and answers with the terminator alone: no snapshot there, a consumer falls back
to replay.

The publisher's identity: `epoch`, random per publisher object, so a restarted process (or a
new publisher on the same address) is a new stream whatever its seqs. It travels in the replay
terminator (`wire.PublisherStatus`). A replay request from a seq beyond the ring is the cheap
first-contact handshake: the terminator alone, with the epoch and the next seq.

vLLM PR #57789 (open), with `snapshot_endpoint` set (else nothing of it, the wire unchanged):
a random 16-byte `publisher_id` after the 8 seq bytes of every live message, an empty batch
(its own seq) after each idle `HEARTBEAT_INTERVAL_S` (sent by the sending thread through
`publish()`: in the ring, the state and the snapshots like any batch), and the snapshot
service (`snapshots.py`), fed each batch before it is sent.

The live socket is an XPUB (on the wire the same as vLLM's PUB): it sees its subscribers'
subscriptions, so `num_subscriptions` and `wait_for_subscriber()` tell whether anyone listens.

Threads: one sends live frames (this module), one serves replays (`replay.py`); each owns its
socket. Every publisher has the same counters (`num_published`, `num_dropped`, ...), zero where
a publisher has no such thing, so callers never ask which kind they hold.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from queue import Empty, SimpleQueue
from typing import Any, ClassVar, Self

import msgspec
import zmq

from kvconnect.config import KVEventsConfig
from kvconnect.events import KVEventBatch, encode_batch
from kvconnect.stream.curve import CurveServerKeys
from kvconnect.stream.replay import ReplayRing, ReplayServer, open_replay_socket
from kvconnect.stream.snapshots import SnapshotServer, open_snapshot_socket
from kvconnect.stream.state import StreamState
from kvconnect.stream.wire import (
    END_SEQ,
    HEARTBEAT_INTERVAL_S,
    MAX_REQUEST_BYTES,
    SNAPSHOT_REQUEST,
    KVEventSource,
    PublisherStatus,
    offset_endpoint,
    seq_frame,
)

logger = logging.getLogger(__name__)

_SUBSCRIPTION_CHECK_EVERY = 256  # live sends between reads of subscription messages when busy


class EventPublisher(ABC):
    """Publishes one `KVEventBatch` per engine step, in order, with a monotonic sequence.

    The counters and addresses below are every publisher's, so a caller (metrics, a ready
    line) reads them without asking which publisher it holds; the defaults are a publisher
    that keeps no such thing.
    """

    endpoint: str | None = None
    """The live stream's address (None: no stream)."""
    replay_endpoint: str | None = None
    """The replay server's address (None: no replay)."""

    def __init__(self, data_parallel_rank: int = 0) -> None:
        self._data_parallel_rank = data_parallel_rank

    @abstractmethod
    def publish(self, batch: KVEventBatch) -> None:
        """Hand over one step's batch; never blocks the caller and never changes `batch`."""

    def source(self) -> KVEventSource | None:
        """Where this rank's stream is, for `GET /kv_event_sources` (the addresses as bound:
        a port 0 is the port the OS chose); None: no stream."""
        return None

    @abstractmethod
    def shutdown(self, timeout: float = 1.0) -> None:
        """Flush within `timeout` seconds, then release sockets and threads; idempotent."""

    @property
    def num_published(self) -> int:
        """Batches given sequence numbers so far (the next seq)."""
        return 0

    @property
    def num_dropped(self) -> int:
        """Batches not sent live because the queue was full (still replayable)."""
        return 0

    @property
    def num_send_errors(self) -> int:
        """Live sends that failed (still replayable)."""
        return 0

    @property
    def num_subscriptions(self) -> int:
        """Subscriptions of connected subscribers, as the live socket last saw them."""
        return 0


class NullEventPublisher(EventPublisher):
    """Publishes nothing: what the engine runs when KV cache events are disabled."""

    def publish(self, batch: KVEventBatch) -> None:
        return None

    def shutdown(self, timeout: float = 1.0) -> None:
        return None


class ZmqEventPublisher(EventPublisher):
    """Publishes batches on a ZMQ XPUB socket and serves replays from a ring of recent batches.

    The rule for `config.endpoint` is vLLM's (see `KVEventsConfig`): unset, `tcp://127.0.0.1:5557`
    is bound; a given one is bound if it has `*` or `::` or is ipc/inproc, and connected to
    otherwise, unless `bind` says which. The DP rank offset applies to both addresses either
    way, as in vLLM. A bound tcp port 0 is the OS's choice: `endpoint` and `replay_endpoint`
    then name the port it chose.
    """

    endpoint: str

    def __init__(
        self,
        config: KVEventsConfig,
        data_parallel_rank: int = 0,
        *,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        super().__init__(data_parallel_rank)
        self.config = config
        self.endpoint = offset_endpoint(config.endpoint, data_parallel_rank) or config.endpoint
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, data_parallel_rank)
        self.snapshot_endpoint = offset_endpoint(config.snapshot_endpoint, data_parallel_rank)
        """PR #57789's snapshot service, as bound; None: off (no id, no heartbeats)."""
        self.publisher_id = uuid.uuid4().bytes if self.snapshot_endpoint is not None else None
        """PR #57789: this publisher's lifetime id, in every live seq frame; None: off."""
        self._id_suffix = self.publisher_id or b""
        self._last_publish = time.monotonic()
        self.num_heartbeats = 0
        self.topic = config.topic
        self._topic_bytes = config.topic.encode()
        self._max_queue_size = config.max_queue_size
        self.epoch = os.urandom(8).hex()

        self._lock = threading.Lock()  # seq order: the ring, the queue, the state feed
        self._next_seq = 0
        self._ring = ReplayRing(config.buffer_steps)
        self._queue: SimpleQueue[tuple[bytes, bytes] | None] = SimpleQueue()
        self._num_queued = 0  # written under the lock by publish()
        self._num_dequeued = 0  # written under the socket lock, after each send
        self._sock_lock = threading.Lock()  # the live socket: publish()'s own sends, the thread
        self._num_dropped = 0
        self._num_send_errors = 0
        self._closed = False
        self._abandon = False
        self._deadline = 0.0
        self._num_subscriptions = 0  # written only by the sending thread
        self._subscriptions_changed = threading.Condition()

        ctx = context or zmq.Context.instance()
        self._pub, replay_sock, snapshot_sock = self._open_sockets(ctx)
        self._snapshots: SnapshotServer | None = None
        if snapshot_sock is not None:
            assert self.publisher_id is not None
            self._snapshots = SnapshotServer(snapshot_sock, self.publisher_id, data_parallel_rank)
        self._sender = threading.Thread(target=self._send_loop, name="kv-events-pub", daemon=True)
        self._sender.start()
        self._replay: ReplayServer | None = None
        if replay_sock is not None:
            self._replay = ReplayServer(
                replay_sock, self._ring, self.status, self._topic_bytes, data_parallel_rank
            )

    @classmethod
    def open(cls, data_parallel_rank: int = 0, **fields: Any) -> Self:
        """A publisher of `KVEventsConfig(enable_kv_cache_events=True, **fields)`, vLLM's
        keyword form (`endpoint=..., replay_endpoint=..., buffer_steps=...`)."""
        context = fields.pop("context", None)
        config = KVEventsConfig(enable_kv_cache_events=True, **fields)
        return cls(config, data_parallel_rank, context=context)

    def _open_sockets(
        self, ctx: zmq.Context[Any]
    ) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None, zmq.Socket[bytes] | None]:
        key_file = self.config.curve_secret_key_file
        try:
            curve = CurveServerKeys.from_file(key_file) if key_file else None
        except ValueError as e:
            raise ValueError(f"KVEventsConfig.curve_secret_key_file={key_file!r}: {e}") from None
        pub: zmq.Socket[bytes] = ctx.socket(zmq.XPUB)
        replay: zmq.Socket[bytes] | None = None
        snapshot: zmq.Socket[bytes] | None = None
        try:
            if curve is not None:
                curve.apply(pub)
            # Every subscribe and unsubscribe (also of a peer that went away) comes up.
            pub.setsockopt(zmq.XPUB_VERBOSER, 1)
            # It reads only subscriptions (b"\x01" + topic prefix).
            pub.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES + len(self._topic_bytes))
            pub.setsockopt(zmq.SNDHWM, self.config.hwm)
            endpoint = offset_endpoint(self.config.endpoint, self._data_parallel_rank)
            assert endpoint is not None  # the config resolved it
            if self.config.binds_endpoint:
                endpoint = _bind(pub, endpoint)
            else:
                pub.connect(endpoint)
            self.endpoint = endpoint
            if self.replay_endpoint is not None:
                replay = open_replay_socket(ctx)
                if curve is not None:
                    curve.apply(replay)
                self.replay_endpoint = _bind(replay, self.replay_endpoint)
            if self.snapshot_endpoint is not None:
                snapshot = open_snapshot_socket(ctx)
                if curve is not None:
                    curve.apply(snapshot)
                self.snapshot_endpoint = _bind(snapshot, self.snapshot_endpoint)
        except zmq.ZMQError as e:
            for sock in (pub, replay, snapshot):
                if sock is not None:
                    sock.close(linger=0)
            raise RuntimeError(
                f"cannot open KV event sockets (endpoint={self.endpoint!r}, "
                f"replay_endpoint={self.replay_endpoint!r}, "
                f"snapshot_endpoint={self.snapshot_endpoint!r}): {e}"
            ) from e
        return pub, replay, snapshot

    def source(self) -> KVEventSource:
        return KVEventSource(
            self._data_parallel_rank, self.endpoint, self.replay_endpoint, self.topic
        )

    # -- caller side ----------------------------------------------------------------------

    def publish(self, batch: KVEventBatch) -> None:
        if self._closed:
            raise RuntimeError("ZmqEventPublisher.publish() called after shutdown()")
        if batch.data_parallel_rank is None:  # stamped on a copy: the caller's stays as it was
            batch = msgspec.structs.replace(batch, data_parallel_rank=self._data_parallel_rank)
        payload = encode_batch(batch)
        with self._lock:
            if self._closed:
                raise RuntimeError("ZmqEventPublisher.publish() called after shutdown()")
            seq = self._next_seq
            self._next_seq = seq + 1
            self._last_publish = time.monotonic()
            seq_bytes = seq_frame(seq)
            with self._ring.lock:
                self._ring.entries.append((seq, seq_bytes, payload))
            if self._replay is not None:
                self._replay.observe(seq, batch)
            if self._snapshots is not None:
                self._snapshots.observe(seq, batch)
            # Live frames carry the id (PR #57789); replay answers keep vLLM's 8 bytes.
            seq_bytes += self._id_suffix
            if self._send_now(seq_bytes, payload):
                return
            if self._num_queued - self._num_dequeued >= self._max_queue_size:
                self._num_dropped += 1
                return
            self._num_queued += 1
            # Inside the lock so that live order is seq order even with several callers.
            self._queue.put((seq_bytes, payload))

    def _send_now(self, seq_bytes: bytes, payload: bytes) -> bool:
        """Send from the caller when nothing is queued and the socket is free: no thread hop
        on the common path. A non-blocking send: a full socket drops the live copy (counted;
        still replayable), exactly as the sending thread would. False: queue it instead."""
        if not self._sock_lock.acquire(blocking=False):
            return False
        try:
            if self._num_queued != self._num_dequeued:  # older batches first
                return False
            try:
                self._pub.send_multipart((self._topic_bytes, seq_bytes, payload), zmq.NOBLOCK)
            except zmq.ZMQError:
                self._num_dropped += 1
            self._num_queued += 1
            self._num_dequeued += 1
            return True
        finally:
            self._sock_lock.release()

    @property
    def num_published(self) -> int:
        return self._next_seq

    @property
    def num_dropped(self) -> int:
        return self._num_dropped

    @property
    def num_send_errors(self) -> int:
        return self._num_send_errors

    @property
    def num_subscriptions(self) -> int:
        return self._num_subscriptions

    @property
    def state(self) -> StreamState:
        """What the stream says is held (kept by the replay thread: read it after shutdown);
        empty without a replay endpoint."""
        return self._replay.state if self._replay is not None else StreamState()

    @property
    def num_replay_requests(self) -> int:
        return self._replay.num_requests if self._replay is not None else 0

    @property
    def num_snapshots(self) -> int:
        return self._replay.num_snapshots if self._replay is not None else 0

    @property
    def num_replay_sessions_dropped(self) -> int:
        return self._replay.num_sessions_dropped if self._replay is not None else 0

    @property
    def num_replay_clients_blocked(self) -> int:
        """Replay clients whose queue is full (they read slower than sent, or not at all)."""
        return self._replay.num_blocked if self._replay is not None else 0

    def wait_for_subscriber(self, timeout: float = 10.0, num_subscriptions: int = 1) -> bool:
        """Block until `num_subscriptions` subscriptions have reached the live socket (so the
        next `publish()` goes to those subscribers); False after `timeout` seconds."""
        with self._subscriptions_changed:
            return self._subscriptions_changed.wait_for(
                lambda: self._num_subscriptions >= num_subscriptions, timeout
            )

    def flush(self, timeout: float = 5.0) -> bool:
        """Block until every batch queued so far has gone to the socket; False on timeout."""
        target = self._num_queued
        deadline = time.monotonic() + timeout
        while self._num_dequeued < target:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def status(self) -> PublisherStatus:
        with self._lock:
            return PublisherStatus(self.epoch, self._next_seq)

    def shutdown(self, timeout: float = 1.0) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._deadline = time.monotonic() + max(0.0, timeout)
            self._queue.put(None)
        self._sender.join(timeout)
        if self._sender.is_alive():
            left = self._num_queued - self._num_dequeued
            logger.warning("KV event publisher: shutdown timed out with %d batches unsent", left)
            self._abandon = True
            self._sender.join(0.5)
        if self._replay is not None:
            self._replay.stop(1.0)
        if self._snapshots is not None:
            self._snapshots.stop(1.0)

    # -- the sending thread -----------------------------------------------------------------

    def _send_loop(self) -> None:
        pub, topic, queue = self._pub, self._topic_bytes, self._queue
        try:
            while True:
                try:
                    item = queue.get_nowait()
                except Empty:
                    with self._sock_lock:
                        self._read_subscriptions(pub)
                    try:
                        item = queue.get(timeout=0.05)
                    except Empty:
                        if self._abandon:
                            break
                        self._heartbeat()
                        continue
                if item is None or self._abandon:
                    break
                with self._sock_lock:
                    try:
                        pub.send_multipart((topic, item[0], item[1]))
                    except zmq.ZMQError as e:
                        self._num_send_errors += 1
                        logger.warning(
                            "KV event publisher: send of seq %d failed: %s",
                            int.from_bytes(item[0], "big"),
                            e,
                        )
                    self._num_dequeued += 1
                    if self._num_dequeued % _SUBSCRIPTION_CHECK_EVERY == 0:
                        self._read_subscriptions(pub)
        finally:
            linger_ms = int(max(0.0, self._deadline - time.monotonic()) * 1000)
            with self._sock_lock:
                pub.close(linger=linger_ms)

    def _heartbeat(self) -> None:
        """PR #57789: an empty batch when nothing was published for HEARTBEAT_INTERVAL_S (only
        with a snapshot endpoint). Through `publish()`, so it is a batch like any other."""
        if self.publisher_id is None or self._closed:
            return
        if time.monotonic() - self._last_publish < HEARTBEAT_INTERVAL_S:
            return
        # Counted first: publish() may send it at once, and a subscriber may read the count
        # as soon as it has the heartbeat.
        self.num_heartbeats += 1
        try:
            self.publish(KVEventBatch(time.time(), [], self._data_parallel_rank))
        except RuntimeError:  # shut down meanwhile: none was sent
            self.num_heartbeats -= 1

    def _read_subscriptions(self, pub: zmq.Socket[bytes]) -> None:
        """Count the subscribe (b"\x01topic") and unsubscribe (b"\x00topic") messages."""
        n = self._num_subscriptions
        while pub.poll(0):
            msg = pub.recv()
            if msg[:1] == b"\x01":
                n += 1
            elif msg[:1] == b"\x00":
                n = max(0, n - 1)
        if n != self._num_subscriptions:
            with self._subscriptions_changed:
                self._num_subscriptions = n
                self._subscriptions_changed.notify_all()


def _bind(sock: zmq.Socket[bytes], endpoint: str) -> str:
    """Bind `endpoint`; the address actually bound (a tcp port 0 becomes the OS's port)."""
    sock.bind(endpoint)
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        bound: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return bound
    return endpoint


PublisherCtor = Callable[[KVEventsConfig, int], EventPublisher]
"""A registered publisher: built from the events config and the DP rank."""


class EventPublisherFactory:
    """Builds the publisher a `KVEventsConfig` names; other publishers can be registered."""

    _registry: ClassVar[dict[str, PublisherCtor]] = {
        "null": lambda _config, rank: NullEventPublisher(rank),
        "zmq": ZmqEventPublisher,
    }

    @classmethod
    def register_publisher(cls, name: str, ctor: PublisherCtor) -> None:
        """Make `ctor` available as publisher `name`; a name can be registered once."""
        if name in cls._registry:
            raise ValueError(f"event publisher {name!r} is already registered")
        cls._registry[name] = ctor

    @classmethod
    def known_publishers(cls) -> list[str]:
        return sorted(cls._registry)

    @classmethod
    def check_known(cls, config: KVEventsConfig) -> None:
        """ValueError unless the publisher `config` names is registered (or events are off)."""
        if config.enable_kv_cache_events and config.publisher not in cls._registry:
            known = ", ".join(cls.known_publishers())
            raise ValueError(f"unknown event publisher {config.publisher!r}; known: {known}")

    @classmethod
    def create(cls, config: KVEventsConfig | None, data_parallel_rank: int = 0) -> EventPublisher:
        """The configured publisher; a null one when events are off. `config` is not changed."""
        if config is None or not config.enable_kv_cache_events or config.publisher == "null":
            return NullEventPublisher(data_parallel_rank)
        cls.check_known(config)
        return cls._registry[config.publisher or ""](config, data_parallel_rank)


__all__ = [
    "END_SEQ",
    "SNAPSHOT_REQUEST",
    "EventPublisher",
    "EventPublisherFactory",
    "NullEventPublisher",
    "PublisherStatus",
    "ZmqEventPublisher",
    "offset_endpoint",
]
