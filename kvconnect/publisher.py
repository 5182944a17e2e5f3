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

Wire (identical to vLLM, see docs/architecture.md):
    live:    [topic, seq (8 bytes big-endian unsigned), payload]
    replay:  request  [b"", start_seq (8 bytes)]           from a DEALER (a REQ adds the b"")
             answer   [b"", topic, seq, payload] ...       every buffered batch >= start_seq
                      [b"", STATUS, END_SEQ, b""]           END_SEQ = -1 as 8 signed bytes
             snapshot [b"", SNAPSHOT_REQUEST]                   (kvconnect's; see below)
             answer   [b"", topic, seq, payload] ...       BlockStored batches, seq = the fence
                      [b"", STATUS, END_SEQ, b""]
A malformed request gets the terminator alone, so no client waits forever.

Snapshots: the publisher keeps the state its stream describes (`stream_state.StreamState`,
applied on the replay thread from every published batch) and answers a snapshot request with
it: every block held, per medium, as BlockStored events in batches that all carry the seq they
are current at (the fence). A consumer drops what it knew of the stream, applies the snapshot,
then every batch after the fence. vLLM's publisher reads the request as a replay from beyond its
ring and answers with the terminator alone: no snapshot there, a consumer falls back to replay.

The publisher's identity: `epoch`, random per publisher object, so a restarted process (or a
new publisher on the same address) is a new stream whatever its seqs. It travels in the
terminator's first frame, where vLLM sends an empty topic and vLLM readers look only at the
last frames (an empty payload, seq -1): `STATUS = b"kvconnect epoch=<16 hex> next_seq=<n>"`.
A replay request from a seq beyond the ring is the cheap first-contact handshake: the
terminator alone, with the epoch and the next seq.

The live socket is an XPUB (on the wire the same as vLLM's PUB): it sees its subscribers'
subscriptions, so `num_subscriptions` and `wait_for_subscriber()` tell whether anyone listens.

Replay service is bounded and fair. Every request becomes a session answered a slice at a time,
round-robin across sessions, with non-blocking sends on a small per-client queue: a client that
does not read fills its own queue and is skipped, so it costs one failed send per round and
never delays another client. A session that makes no progress for `REPLAY_STALL_S` is dropped,
and at `MAX_REPLAY_SESSIONS` the least recently progressing one makes room, so the work spent
on clients that do not read is bounded by the session count times their socket buffers; within
a round the least served session goes first. What waits for a client is bounded by its queue
(64 messages), so memory stays within the ring plus a small per-client overhead.

Threads: one sends live frames, one serves replays and keeps the stream state; each owns its
socket. The ring is shared under a lock held only for an append or a slice.
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
from kvconnect.stream_state import StreamState

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
SNAPSHOT_REQUEST = b"kvconnect snapshot"
_STATUS_PREFIX = b"kvconnect "
_SUBSCRIPTION_CHECK_EVERY = 256  # live sends between reads of subscription messages when busy

REPLAY_SLICE = 256
"""Messages a session may send per round before the next session's turn."""
REPLAY_CLIENT_HWM = 64
"""Messages queued per replay client before its sends fail (and it is skipped)."""
REPLAY_CLIENT_SNDBUF = 1 << 16
"""Kernel send buffer per replay connection, bytes."""
REPLAY_STALL_S = 10.0
"""A session with no send accepted for this long is dropped."""
MAX_REPLAY_SESSIONS = 64
"""Sessions served at once; a new request beyond it replaces the one that progressed least
recently (a client that reads keeps progressing, so a crowd that does not cannot evict it)."""
SNAPSHOT_EVENTS_PER_BATCH = 1024


@dataclass
class _Session:
    """One client's replay (or snapshot) answer in progress."""

    identity: bytes
    next_seq: int
    """The next ring seq to send (replay)."""
    end_seq: int
    """Send ring entries below this seq (the next seq when the request came)."""
    status: bytes
    parts: deque[tuple[bytes, bytes]] | None = None
    """A snapshot's (seq, payload) messages still to send; None for a replay."""
    last_progress: float = 0.0
    num_sent: int = 0
    """Messages sent so far: the least served session goes first in each round."""


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
        self._num_dequeued = 0  # written under the socket lock, after each send
        self._sock_lock = threading.Lock()  # the live socket: publish()'s own sends, the thread
        self._num_dropped = 0
        self._num_send_errors = 0
        self._closed = False
        self._abandon = False
        self._deadline = 0.0
        self._stop = threading.Event()
        self.epoch = os.urandom(8).hex()
        self._num_subscriptions = 0  # written only by the sending thread
        self._subscriptions_changed = threading.Condition()
        # Published batches for the replay thread's StreamState (only with a replay socket).
        self._for_state: SimpleQueue[tuple[int, KVEventBatch]] | None = (
            SimpleQueue() if replay_endpoint is not None else None
        )
        self.state = StreamState()
        """What the stream says is held (kept by the replay thread; read it only there or
        after shutdown)."""
        self.num_replay_requests = 0
        self.num_snapshots = 0
        self.num_replay_sessions_dropped = 0

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
                self._router.setsockopt(zmq.SNDHWM, REPLAY_CLIENT_HWM)
                # A fixed kernel buffer (no autotuning to megabytes): a client that does not
                # read can absorb only this much before its sends fail.
                self._router.setsockopt(zmq.SNDBUF, REPLAY_CLIENT_SNDBUF)
                # A send to a full or departed client fails instead of being dropped silently.
                self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
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
            if self._closed:
                raise RuntimeError("ZmqEventPublisher.publish() called after shutdown()")
            seq = self._next_seq
            self._next_seq = seq + 1
            seq_bytes = seq.to_bytes(8, "big")
            self._ring.append((seq, seq_bytes, payload))
            if self._for_state is not None:
                self._for_state.put((seq, batch))
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
                    with self._sock_lock:
                        self._read_subscriptions(pub)
                    try:
                        item = queue.get(timeout=0.05)
                    except Empty:
                        if self._abandon:
                            break
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
        sessions: dict[bytes, _Session] = {}
        try:
            while not self._stop.is_set():
                self._apply_state()
                busy = self._serve_round(router, sessions)
                # Idle, or every client's queue full: wait for requests a moment, else go on.
                if router.poll(0 if busy else 5 if sessions else 50):
                    for _ in range(256):  # take what is there, then serve again
                        try:
                            frames = router.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._accept(router, sessions, frames)
        finally:
            router.close(linger=0)

    def _apply_state(self) -> None:
        queue = self._for_state
        assert queue is not None
        state = self.state
        while True:
            try:
                seq, batch = queue.get_nowait()
            except Empty:
                return
            state.apply(seq, batch)

    def _accept(
        self, router: zmq.Socket[bytes], sessions: dict[bytes, _Session], frames: list[bytes]
    ) -> None:
        identity = frames[0]
        self.num_replay_requests += 1
        now = time.monotonic()
        if len(frames) == 3 and frames[1] == b"" and frames[2] == SNAPSHOT_REQUEST:
            self._apply_state()
            self.num_snapshots += 1
            state = self.state
            fence = max(0, state.seq).to_bytes(8, "big")
            events = state.events()
            # Nothing published yet: no snapshot (replay from 0 is the whole stream). Else at
            # least one batch, which names the stream (topic, rank) even when it holds nothing.
            num = 0 if state.seq < 0 else max(1, len(events))
            parts = deque(
                (
                    fence,
                    encode_batch(
                        KVEventBatch(
                            time.time(),
                            list(events[i : i + SNAPSHOT_EVENTS_PER_BATCH]),
                            self._data_parallel_rank,
                        )
                    ),
                )
                for i in range(0, num, SNAPSHOT_EVENTS_PER_BATCH)
            )
            answered = PublisherStatus(self.epoch, state.seq + 1).encode()
            session = _Session(identity, 0, 0, answered, parts, now)
        elif len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            logger.warning(
                "KV event replay: malformed request (%d frames); sent terminator", len(frames)
            )
            session = _Session(identity, 0, 0, self.status().encode(), None, now)
        else:
            start_seq = int.from_bytes(frames[2], "big")
            status = self.status()
            session = _Session(identity, start_seq, status.next_seq, status.encode(), None, now)
        if identity in sessions:  # a new request replaces the client's unfinished answer
            del sessions[identity]
        elif len(sessions) >= MAX_REPLAY_SESSIONS:
            victim = min(sessions.values(), key=lambda s: s.last_progress)
            del sessions[victim.identity]
            self._dropped(
                "more than %d replay clients at once: the least recent", MAX_REPLAY_SESSIONS
            )
        sessions[identity] = session

    def _dropped(self, why: str, arg: float) -> None:
        """Count a dropped session; log the first and then one in every 1,000."""
        self.num_replay_sessions_dropped += 1
        n = self.num_replay_sessions_dropped
        if n == 1 or n % 1000 == 0:
            logger.warning("KV event replay: " + why + "; dropped it (%d so far)", arg, n)

    def _serve_round(self, router: zmq.Socket[bytes], sessions: dict[bytes, _Session]) -> bool:
        """One slice of every session's answer; whether any send went through."""
        progressed = False
        now = time.monotonic()
        for session in sorted(sessions.values(), key=lambda s: s.num_sent):
            try:
                sent = self._serve_slice(router, session)
            except zmq.ZMQError as e:  # EHOSTUNREACH: the client went away
                del sessions[session.identity]
                if e.errno != zmq.EHOSTUNREACH:
                    logger.warning("KV event replay: send failed: %s", e)
                continue
            if sent:
                progressed = True
                session.last_progress = now
                session.num_sent += sent
            if sent is None:
                del sessions[session.identity]  # answered whole
                progressed = True
            elif now - session.last_progress > REPLAY_STALL_S:
                del sessions[session.identity]
                self._dropped("a replay client read nothing for %.0fs", REPLAY_STALL_S)
        return progressed

    def _serve_slice(self, router: zmq.Socket[bytes], session: _Session) -> int | None:
        """Send up to REPLAY_SLICE messages of `session`'s answer: how many went (None: the
        terminator went too, the answer is complete). zmq.Again stops at a full queue."""
        ident, topic, sent = session.identity, self._topic_bytes, 0
        flags = zmq.NOBLOCK
        try:
            if session.parts is not None:
                parts = session.parts
                while parts and sent < REPLAY_SLICE:
                    seq_bytes, payload = parts[0]
                    router.send_multipart((ident, b"", topic, seq_bytes, payload), flags)
                    parts.popleft()
                    sent += 1
                if parts:
                    return sent
            else:
                with self._lock:
                    ring = self._ring
                    first = ring[0][0] if ring else session.end_seq
                    # Batches the ring dropped meanwhile are skipped: the client sees the gap.
                    session.next_seq = max(session.next_seq, first)
                    lo = session.next_seq - first
                    hi = min(session.end_seq - first, lo + REPLAY_SLICE, len(ring))
                    entries = [ring[i] for i in range(lo, hi)] if lo < hi else []
                for seq, seq_bytes, payload in entries:
                    router.send_multipart((ident, b"", topic, seq_bytes, payload), flags)
                    session.next_seq = seq + 1
                    sent += 1
                if session.next_seq < session.end_seq and session.next_seq - first < len(ring):
                    return sent
            # The next seq as of the request: every batch before it was in this answer or live.
            router.send_multipart((ident, b"", session.status, END_SEQ, b""), flags)
            return None
        except zmq.Again:
            return sent


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
    "SNAPSHOT_REQUEST",
    "EventPublisher",
    "EventPublisherFactory",
    "NullEventPublisher",
    "PublisherStatus",
    "ZmqEventPublisher",
    "offset_endpoint",
]
