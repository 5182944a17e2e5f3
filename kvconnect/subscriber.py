"""A subscriber that yields every KV event batch of each publisher once, in order.

Reads vLLM's stream unchanged (live frames `[topic, seq, payload]`, replay v1 or v2 answers).
Per publisher stream it keeps the last seq it yielded and:
- a seq gap: fetches the missing batches from the publisher's replay socket (DEALER) before
  the live batch; what replay no longer holds becomes an `EventsLost(first, last)` item;
- a seq equal to or below the last one: the publisher restarted (live order from one
  publisher is FIFO, so nothing else makes seq go back); yields `PublisherRestarted` and then
  the new stream from seq 0, through replay where needed;
- `start_seq` (e.g. 0): on a stream's first batch, catches up from that seq through replay,
  which covers the slow-joiner gap and a subscriber restarted mid-stream;
- frames that are not 3 frames with an 8-byte seq, and payloads that do not decode, are
  counted and skipped with a log line; nothing a peer sends ends the subscriber.

Streams: one socket per endpoint. Connected to publishers that bind (the usual layout) each
endpoint is one publisher. With `bind=True` several publishers may connect to one address;
their streams are told apart by topic and `data_parallel_rank`, and `replay_endpoint` may
then map a rank to its publisher's replay address.

Single-threaded: iterate (or call `recv`) from one thread; `close()` may come from any thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from kvconnect.events import EventDecodeError, KVEventBatch, decode_batch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamId:
    """One publisher's stream as the subscriber sees it."""

    endpoint: str
    topic: str
    data_parallel_rank: int | None


@dataclass(frozen=True)
class PublisherRestarted:
    """The publisher of `stream` restarted: drop what it told you before this item."""

    stream: StreamId
    last_seq: int
    """The last seq received from the previous publisher."""
    first_seq: int
    """The first live seq received from the new one."""


@dataclass(frozen=True)
class EventsLost:
    """Batches `first_seq..last_seq` (inclusive) of `stream` could not be recovered."""

    stream: StreamId
    first_seq: int
    last_seq: int


class ReceivedBatch(tuple[int, KVEventBatch]):
    """`(seq, batch)`, plus the `stream` it came from."""

    stream: StreamId

    def __new__(cls, seq: int, batch: KVEventBatch, stream: StreamId) -> ReceivedBatch:
        self = super().__new__(cls, (seq, batch))
        self.stream = stream
        return self

    @property
    def seq(self) -> int:
        return self[0]

    @property
    def batch(self) -> KVEventBatch:
        return self[1]


SubscriberItem = ReceivedBatch | PublisherRestarted | EventsLost
ReplayEndpoints = str | Sequence[str | None] | Mapping[int, str] | None


@dataclass
class _Stream:
    id: StreamId
    source: int
    last_seq: int | None = None


class KVEventSubscriber:
    """Subscribe to one or more KV event publishers; iterate to get their batches in order."""

    def __init__(
        self,
        endpoint: str | Sequence[str],
        replay_endpoint: ReplayEndpoints = None,
        topic: str = "",
        *,
        bind: bool = False,
        start_seq: int | None = None,
        replay_timeout: float = 2.0,
        hwm: int = 100_000,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.endpoints = [endpoint] if isinstance(endpoint, str) else list(endpoint)
        if not self.endpoints:
            raise ValueError("endpoint: at least one endpoint is needed")
        self._replay = self._check_replay(replay_endpoint)
        if start_seq is not None and start_seq < 0:
            raise ValueError(f"start_seq must be >= 0, got {start_seq}")
        self._start_seq = start_seq
        self._replay_timeout = replay_timeout
        self._topic = topic.encode()
        self._ctx = context or zmq.Context.instance()
        self._poller = zmq.Poller()
        self._subs: list[zmq.Socket[bytes]] = []
        self._dealers: dict[str, zmq.Socket[bytes]] = {}
        self._streams: dict[tuple[int, bytes, int | None], _Stream] = {}
        self._pending: deque[SubscriberItem] = deque()
        self._closed = False
        self._polling = False
        self._state_lock = threading.Lock()
        self.num_bad_frames = 0
        self.num_decode_errors = 0
        self.num_gaps_repaired = 0
        self.num_batches_replayed = 0
        self.num_batches_lost = 0
        for ep in self.endpoints:
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.RCVHWM, hwm)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, self._topic)
            try:
                sub.bind(ep) if bind else sub.connect(ep)
            except zmq.ZMQError as e:
                sub.close()
                self.close()
                raise ValueError(f"cannot {'bind' if bind else 'connect'} {ep!r}: {e}") from e
            self._subs.append(sub)
            self._poller.register(sub, zmq.POLLIN)

    def _check_replay(self, replay: ReplayEndpoints) -> ReplayEndpoints:
        if isinstance(replay, str) and len(self.endpoints) > 1:
            raise ValueError("replay_endpoint: give one per endpoint (a list) or a rank mapping")
        if (
            isinstance(replay, Sequence)
            and not isinstance(replay, str)
            and len(replay) != len(self.endpoints)
        ):
            raise ValueError(
                f"replay_endpoint: {len(replay)} given for {len(self.endpoints)} endpoints"
            )
        return replay

    def _replay_for(self, stream: _Stream) -> str | None:
        replay = self._replay
        if replay is None or isinstance(replay, str):
            return replay
        if isinstance(replay, Mapping):
            rank = stream.id.data_parallel_rank
            return replay.get(rank) if rank is not None else None
        return replay[stream.source]

    # -- reading ------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[SubscriberItem]:
        while not self._closed:
            item = self.recv(timeout=0.1)
            if item is not None:
                yield item

    def recv(self, timeout: float | None = None) -> SubscriberItem | None:
        """The next item, or None if none arrived within `timeout` seconds (None: wait)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._pending:
            with self._state_lock:
                if self._closed:
                    self._close_sockets()
                    return None
                self._polling = True
            try:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                # Wake up now and then so that close() from another thread is noticed.
                ready = self._poller.poll(100 if left is None else min(100, int(left * 1000)))
                for sock, _ in ready:
                    self._on_live(self._subs.index(sock), sock.recv_multipart())
            finally:
                with self._state_lock:
                    self._polling = False
            if not ready and deadline is not None and time.monotonic() >= deadline:
                return None
        return self._pending.popleft()

    def _on_live(self, source: int, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.num_bad_frames += 1
            logger.warning(
                "KV event subscriber: skipped a message of %d frames that is not "
                "[topic, seq(8 bytes), payload]",
                len(frames),
            )
            return
        topic, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        batch = self._decode(payload, seq)
        if batch is None:
            return
        stream = self._stream(source, topic, batch.data_parallel_rank)
        last = stream.last_seq
        if last is None:
            if self._start_seq is not None and seq > self._start_seq:
                self._fill(stream, self._start_seq, seq)
        elif seq <= last:
            self._pending.append(PublisherRestarted(stream.id, last, seq))
            if seq > 0:
                self._fill(stream, 0, seq)
        elif seq > last + 1:
            self._fill(stream, last + 1, seq)
        self._pending.append(ReceivedBatch(seq, batch, stream.id))
        stream.last_seq = seq

    def _stream(self, source: int, topic: bytes, rank: int | None) -> _Stream:
        key = (source, topic, rank)
        stream = self._streams.get(key)
        if stream is None:
            sid = StreamId(self.endpoints[source], topic.decode(errors="replace"), rank)
            stream = self._streams[key] = _Stream(sid, source)
        return stream

    def _decode(self, payload: bytes, seq: int) -> KVEventBatch | None:
        try:
            return decode_batch(payload)
        except EventDecodeError as e:
            self.num_decode_errors += 1
            logger.warning("KV event subscriber: skipped undecodable batch seq=%d: %s", seq, e)
            return None

    def _fill(self, stream: _Stream, first: int, end: int) -> None:
        """Queue batches [first, end) of `stream` from replay, and `EventsLost` for the rest."""
        replay = self._replay_for(stream)
        answers = self._request_replay(replay, first) if replay else []
        expected = first
        for seq, payload in answers:
            if seq < expected or seq >= end:
                continue
            batch = self._decode(payload, seq)
            if batch is not None:
                if seq > expected:
                    self._lost(stream, expected, seq - 1)
                self._pending.append(ReceivedBatch(seq, batch, stream.id))
                self.num_batches_replayed += 1
            expected = seq + 1
        if expected < end:
            self._lost(stream, expected, end - 1)
        else:
            self.num_gaps_repaired += 1

    def _lost(self, stream: _Stream, first: int, last: int) -> None:
        self.num_batches_lost += last - first + 1
        logger.warning("KV event subscriber: %s lost batches %d..%d", stream.id, first, last)
        self._pending.append(EventsLost(stream.id, first, last))

    def _request_replay(self, endpoint: str, start_seq: int) -> list[tuple[int, bytes]]:
        """`(seq, payload)` of every batch the publisher still holds from `start_seq` on."""
        sock = self._dealers.get(endpoint)
        if sock is None:
            sock = self._dealers[endpoint] = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
        out: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + self._replay_timeout
        try:
            sock.send_multipart((b"", start_seq.to_bytes(8, "big")), flags=zmq.NOBLOCK)
            while True:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not sock.poll(left_ms):
                    raise TimeoutError(f"no complete replay answer in {self._replay_timeout}s")
                frames = sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if not frames or frames[-1] == b"":
                    return out  # terminator, v1 [END_SEQ, b""] or v2 [b"", END_SEQ, b""]
                # v2 answers carry the topic first, v1 answers do not.
                if len(frames) in (2, 3) and len(frames[-2]) == 8:
                    out.append((int.from_bytes(frames[-2], "big"), frames[-1]))
                else:
                    self.num_bad_frames += 1
        except (zmq.ZMQError, TimeoutError) as e:
            logger.warning("KV event subscriber: replay from %s failed: %s", endpoint, e)
            # Late answers would be mistaken for the next request's: start a fresh socket.
            self._dealers.pop(endpoint).close(linger=0)
            return out

    def close(self) -> None:
        """Close every socket; iteration ends. Idempotent. Safe from another thread: the
        reading thread then closes the sockets within 0.1 s."""
        with self._state_lock:
            self._closed = True
            if not self._polling:
                self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in [*self._subs, *self._dealers.values()]:
            sock.close(linger=0)
        self._subs.clear()
        self._dealers.clear()

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "EventsLost",
    "KVEventSubscriber",
    "PublisherRestarted",
    "ReceivedBatch",
    "StreamId",
    "SubscriberItem",
]
