"""Event publishers: how the step owner's `KVEventBatch`es leave the process.

Contract:
- `publish(batch)` is called by the step owner (the scheduler), once per step with that step's
  events. It never blocks: the ZMQ publisher stamps the rank and the sequence number, encodes,
  stores the bytes in the replay ring and queues them for the sending thread, then returns.
  When the queue is full the batch is not sent live (counted in `num_dropped`) but stays
  replayable, so a subscriber that sees the gap fetches it. Calling it after `shutdown()`
  raises `RuntimeError`.
- `shutdown(timeout)` sends what it can within `timeout` seconds, then closes; calling it
  again does nothing.

Wire (identical to vLLM, see docs/architecture.md):
    live:    [topic, seq (8 bytes big-endian unsigned), payload]
    replay:  request  [b"", start_seq (8 bytes)]           from a DEALER (a REQ adds the b"")
             answer   [b"", topic, seq, payload] ...       every buffered batch >= start_seq
                      [b"", STATUS, END_SEQ, b""]           END_SEQ = -1 as 8 signed bytes
A malformed request gets the terminator alone, so no client waits forever.

The publisher's identity: `epoch`, random per publisher object, so a restarted process (or a
new publisher on the same address) is a new stream whatever its seqs. It travels in the
terminator's first frame, where vLLM sends an empty topic and vLLM readers look only at the
last frames (an empty payload, seq -1): `STATUS = b"kvconnect epoch=<16 hex> next_seq=<n>"`.
A replay request from a seq beyond the ring is the cheap first-contact handshake: the
terminator alone, with the epoch and the next seq.

The live socket is an XPUB (on the wire the same as vLLM's PUB): it sees its subscribers'
subscriptions, so `num_subscriptions` and `wait_for_subscriber()` tell whether anyone listens.

Threads: one sends live frames, one serves replays; each owns its socket. The ring is shared
under a lock held only for an append or a snapshot.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, fields
from queue import Empty, SimpleQueue
from typing import Any, ClassVar

import zmq

from kvconnect.config import KVEventsConfig
from kvconnect.events import KVEventBatch, encode_batch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_STATUS_PREFIX = b"kvconnect "
_SUBSCRIPTION_CHECK_EVERY = 256  # live sends between reads of subscription messages when busy


@dataclass(frozen=True)
class PublisherStatus:
    """What a kvconnect publisher says about itself in a replay terminator."""

    epoch: str
    """Random per publisher: a different epoch on the same address is a restart."""
    next_seq: int
    """The seq its next batch will get."""

    def encode(self) -> bytes:
        return _STATUS_PREFIX + f"epoch={self.epoch} next_seq={self.next_seq}".encode()

    @classmethod
    def decode(cls, frame: bytes) -> PublisherStatus | None:
        """The status in a terminator's first frame; None for any other frame (vLLM's b"")."""
        if not frame.startswith(_STATUS_PREFIX):
            return None
        try:
            fields_ = dict(p.split("=", 1) for p in frame[len(_STATUS_PREFIX) :].decode().split())
            return cls(fields_["epoch"], int(fields_["next_seq"]))
        except (ValueError, KeyError, UnicodeDecodeError):
            return None


class EventPublisher(ABC):
    """Publishes one `KVEventBatch` per engine step, in order, with a monotonic sequence."""

    def __init__(self, data_parallel_rank: int = 0) -> None:
        self._data_parallel_rank = data_parallel_rank

    @abstractmethod
    def publish(self, batch: KVEventBatch) -> None:
        """Hand over one step's batch; never blocks the caller."""

    @abstractmethod
    def shutdown(self, timeout: float = 1.0) -> None:
        """Flush within `timeout` seconds, then release sockets and threads; idempotent."""


class NullEventPublisher(EventPublisher):
    """Publishes nothing: what the engine runs when KV cache events are disabled."""

    def publish(self, batch: KVEventBatch) -> None:
        return None

    def shutdown(self, timeout: float = 1.0) -> None:
        return None


def offset_endpoint(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """The endpoint of DP rank `data_parallel_rank`: tcp ports move up by the rank (port 0,
    the OS's choice, stays), ipc and inproc names get `_dp<rank>` appended (vLLM rejects ipc
    here; kvconnect does not)."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("tcp://"):
        head, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{head}:{int(port) + data_parallel_rank}"
    raise ValueError(f"invalid endpoint {endpoint!r}: must be tcp://, ipc:// or inproc://")


class ZmqEventPublisher(EventPublisher):
    """Publishes batches on a ZMQ PUB socket and serves replays from a ring of recent batches.

    Keywords are vLLM's, and so is the rule for `endpoint` (see `KVEventsConfig`): with no
    endpoint, `tcp://127.0.0.1:5557` is bound; a given one is bound if it has `*` or `::` or
    is ipc/inproc, and connected to otherwise, unless `bind` says which. The DP rank offset
    applies to both addresses either way, as in vLLM. A bound tcp port 0 is the OS's choice:
    `endpoint` and `replay_endpoint` then name the port it chose.
    """

    def __init__(
        self,
        data_parallel_rank: int = 0,
        endpoint: str | None = None,
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
        *,
        bind: bool | None = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        super().__init__(data_parallel_rank)
        # Validate and resolve as the config does, so direct construction behaves the same.
        config = KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint=endpoint,  # type: ignore[arg-type]
            replay_endpoint=replay_endpoint,
            buffer_steps=buffer_steps,
            hwm=hwm,
            max_queue_size=max_queue_size,
            topic=topic,
            bind=bind,
        )
        self._bind = config.binds_endpoint
        self.endpoint = offset_endpoint(config.endpoint, data_parallel_rank) or config.endpoint
        self.replay_endpoint = offset_endpoint(replay_endpoint, data_parallel_rank)
        self.topic = topic
        self._topic_bytes = topic.encode()
        self._max_queue_size = max_queue_size

        self._lock = threading.Lock()
        self._next_seq = 0
        self._ring: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer_steps)
        self._queue: SimpleQueue[tuple[bytes, bytes] | None] = SimpleQueue()
        self._num_queued = 0  # written under the lock by publish()
        self._num_dequeued = 0  # written only by the sending thread, after each send
        self._num_dropped = 0
        self._num_send_errors = 0
        self._closed = False
        self._abandon = False
        self._deadline = 0.0
        self._stop = threading.Event()
        self.epoch = os.urandom(8).hex()
        self._num_subscriptions = 0  # written only by the sending thread
        self._subscriptions_changed = threading.Condition()

        ctx = context or zmq.Context.instance()
        self._pub = ctx.socket(zmq.XPUB)
        self._router: zmq.Socket[bytes] | None = None
        try:
            # Every subscribe and unsubscribe (also of a peer that went away) comes up.
            self._pub.setsockopt(zmq.XPUB_VERBOSER, 1)
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            if self._bind:
                self.endpoint = _bind(self._pub, self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._router = ctx.socket(zmq.ROUTER)
                # A full replay is buffer_steps + 1 messages; leave room for a few at once.
                self._router.setsockopt(zmq.SNDHWM, 4 * (buffer_steps + 1))
                self.replay_endpoint = _bind(self._router, self.replay_endpoint)
        except zmq.ZMQError as e:
            self._pub.close(linger=0)
            if self._router is not None:
                self._router.close(linger=0)
            raise RuntimeError(
                f"cannot open KV event sockets (endpoint={self.endpoint!r}, "
                f"replay_endpoint={self.replay_endpoint!r}): {e}"
            ) from e

        self._sender = threading.Thread(target=self._send_loop, name="kv-events-pub", daemon=True)
        self._sender.start()
        self._replayer: threading.Thread | None = None
        if self._router is not None:
            self._replayer = threading.Thread(
                target=self._replay_loop, name="kv-events-replay", daemon=True
            )
            self._replayer.start()

    # -- caller side ----------------------------------------------------------------------

    def publish(self, batch: KVEventBatch) -> None:
        if self._closed:
            raise RuntimeError("ZmqEventPublisher.publish() called after shutdown()")
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self._data_parallel_rank
        payload = encode_batch(batch)
        with self._lock:
            seq = self._next_seq
            self._next_seq = seq + 1
            seq_bytes = seq.to_bytes(8, "big")
            self._ring.append((seq, seq_bytes, payload))
            if self._num_queued - self._num_dequeued >= self._max_queue_size:
                self._num_dropped += 1
                return
            self._num_queued += 1
            # Inside the lock so that live order is seq order even with several callers.
            self._queue.put((seq_bytes, payload))

    @property
    def num_published(self) -> int:
        """Batches given sequence numbers so far (the next seq)."""
        return self._next_seq

    @property
    def num_dropped(self) -> int:
        """Batches not sent live because the queue was full (still replayable)."""
        return self._num_dropped

    @property
    def num_send_errors(self) -> int:
        """Live sends that failed (still replayable)."""
        return self._num_send_errors

    @property
    def num_subscriptions(self) -> int:
        """Subscriptions of connected subscribers, as the live socket last saw them."""
        return self._num_subscriptions

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
        self._stop.set()
        if self._replayer is not None:
            self._replayer.join(1.0)

    # -- threads ----------------------------------------------------------------------------

    def _send_loop(self) -> None:
        pub, topic, queue = self._pub, self._topic_bytes, self._queue
        try:
            while True:
                try:
                    item = queue.get_nowait()
                except Empty:
                    self._read_subscriptions(pub)
                    try:
                        item = queue.get(timeout=0.05)
                    except Empty:
                        if self._abandon:
                            break
                        continue
                if item is None or self._abandon:
                    break
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
            pub.close(linger=linger_ms)

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

    def _replay_loop(self) -> None:
        router = self._router
        assert router is not None
        try:
            while not self._stop.is_set():
                if router.poll(50):
                    self._serve_replay(router, router.recv_multipart())
        finally:
            router.close(linger=0)

    def _serve_replay(self, router: zmq.Socket[bytes], frames: list[bytes]) -> None:
        identity = frames[0]
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            logger.warning(
                "KV event replay: malformed request (%d frames); sent terminator", len(frames)
            )
            router.send_multipart((identity, b"", self.status().encode(), END_SEQ, b""))
            return
        start_seq = int.from_bytes(frames[2], "big")
        with self._lock:
            ring = self._ring
            # Seqs in the ring are contiguous, so the start is found by arithmetic.
            skip = max(0, start_seq - ring[0][0]) if ring else 0
            entries = list(ring)[skip:] if skip < len(ring) else []
            status = PublisherStatus(self.epoch, self._next_seq)
        topic = self._topic_bytes
        for _, seq_bytes, payload in entries:
            router.send_multipart((identity, b"", topic, seq_bytes, payload))
        # The next seq as of the snapshot: every batch before it was in this answer or live.
        router.send_multipart((identity, b"", status.encode(), END_SEQ, b""))


def _bind(sock: zmq.Socket[bytes], endpoint: str) -> str:
    """Bind `endpoint`; the address actually bound (a tcp port 0 becomes the OS's port)."""
    sock.bind(endpoint)
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        bound: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return bound
    return endpoint


PublisherCtor = Callable[..., EventPublisher]


class EventPublisherFactory:
    """Builds the publisher a `KVEventsConfig` names; other publishers can be registered."""

    _registry: ClassVar[dict[str, PublisherCtor]] = {
        "null": NullEventPublisher,
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
        ctor = cls._registry[config.publisher or ""]
        skip = ("publisher", "enable_kv_cache_events")
        kwargs = {f.name: getattr(config, f.name) for f in fields(config) if f.name not in skip}
        return ctor(data_parallel_rank=data_parallel_rank, **kwargs)


__all__ = [
    "END_SEQ",
    "EventPublisher",
    "EventPublisherFactory",
    "NullEventPublisher",
    "PublisherStatus",
    "ZmqEventPublisher",
    "offset_endpoint",
]
