"""A subscriber that yields every KV event batch of each publisher once, in order.

Reads vLLM's stream unchanged (live frames `[topic, seq, payload]`, replay v1 or v2 answers).
Per publisher stream it keeps the last seq it yielded and:
- a seq gap: fetches the missing batches from the publisher's replay socket (DEALER) before
  the live batch; what replay no longer holds becomes an `EventsLost(first, last)` item;
- a restarted publisher: yields `PublisherRestarted`, then the new stream from seq 0, through
  replay where needed. A kvconnect publisher names itself in every replay terminator (its
  `epoch`, see wire.py), so a restart is seen whatever the seqs; a publisher that does not
  (vLLM's) is taken to have restarted when its seq goes back;
- `start_seq` (e.g. 0): catches up from that seq through replay as soon as the connection is
  up, so an idle publisher's history arrives without waiting for its next batch;
- frames that are not 3 frames with an 8-byte (or 24-byte) seq, and payloads that do not decode, are
  counted and skipped with a log line; nothing a peer sends ends the subscriber;
- `snapshots=True`: at first contact, and after any loss replay cannot repair, asks a kvconnect
  publisher for the full state of its stream and yields it as a `StreamSnapshot` (replace what
  you hold for that stream), then the batches after its fence, so a consumer's view converges
  to the instance's truth whatever it missed. A publisher without snapshots (vLLM's) answers
  with nothing, and the subscriber goes on as without the option;
- `snapshot_endpoint` (vLLM PR #57789, open; with `snapshots=True`): the publisher's snapshot
  service. Its bootstrap is the PR's: wait for a live message (a heartbeat comes within a
  second), ask for the snapshot while live batches wait in the socket, yield it as a
  `StreamSnapshot` at the seq it names, then only the batches after it, from the same
  publisher id; a gap replay cannot fill, or a new id (a restart: `PublisherRestarted`),
  bootstraps again. An unavailable snapshot (-2) or none in time: as without it;
- live seq frames of 8 bytes (vLLM's) or 8 + a 16-byte publisher id (PR #57789) are read
  alike; empty batches (its heartbeats) are batches like any other;
- `caught_up`: the endpoints whose state it has queued whole (snapshot and replay); a
  consumer that must not act on a partial view (the router's first decision) waits for them;
- `max_message_size`: a frame larger than this (default `wire.MAX_BATCH_BYTES`, 64 MiB, over
  the largest legitimate batch) cuts that connection before it is read; the subscriber
  connects again, and what it missed is replayed or reported lost;
- `curve`: the publisher's public key and this subscriber's key pair (`stream/curve.py`), for
  a publisher with `curve_secret_key_file`; without them such a publisher says nothing.

The handshake. Whenever a connection to a publisher comes up (the first time, and after every
reconnect) the subscriber asks that publisher's replay socket for everything after the last
seq it has (or from `start_seq`, or nothing, just the terminator): that tells it the
publisher's epoch and fills what it missed while away. Live batches that the answer already
delivered are dropped as duplicates (`num_duplicates`).

Streams: one socket per endpoint. Connected to publishers that bind (the usual layout) each
endpoint is one publisher. With `bind=True` several publishers may connect to one address;
their streams are told apart by topic and `data_parallel_rank`, `replay_endpoint` may then map
a rank to its publisher's replay address, and catching up waits for a stream's first batch.

Single-threaded: iterate (or call `recv`) from one thread; `close()` may come from any thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvconnect.events import EventDecodeError, KVEventBatch, decode_batch
from kvconnect.stream.curve import CurveClientKeys
from kvconnect.stream.wire import (
    END_SEQ,
    MAX_BATCH_BYTES,
    SNAPSHOT_NONE,
    SNAPSHOT_REQUEST,
    PublisherStatus,
    split_seq_frame,
)

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
    """The seq the new publisher's stream resumes from here (its batches before it, if any,
    follow through replay)."""


@dataclass(frozen=True)
class EventsLost:
    """Batches `first_seq..last_seq` (inclusive) of `stream` could not be recovered."""

    stream: StreamId
    first_seq: int
    last_seq: int


@dataclass(frozen=True)
class StreamSnapshot:
    """Everything `stream`'s publisher holds as of `seq`, as BlockStored events in `batch`:
    drop what you knew of the stream and apply this; the batches after `seq` follow."""

    stream: StreamId
    seq: int
    batch: KVEventBatch


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


SubscriberItem = ReceivedBatch | PublisherRestarted | EventsLost | StreamSnapshot
ReplayEndpoints = str | Sequence[str | None] | Mapping[int, str] | None


_DRAIN = 16  # live messages read per socket per poll
_PROBE_SEQ = 2**64 - 1  # a replay from here returns only the terminator (with the status)
_MONITORED = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
_RECONNECT_NOTICE_MS = 100
"""After a disconnect, how long libzmq may take to say it reconnects (it does so at once)."""


@dataclass
class _Stream:
    id: StreamId
    source: int
    last_seq: int | None = None
    dup_until: int = -1
    """Live batches up to this seq were already yielded from a handshake's replay."""
    epoch: str | None = None
    """The publisher's epoch (bind layout, where one address has many publishers)."""


@dataclass
class _Source:
    """One endpoint the subscriber reads, and what it knows of the publisher behind it."""

    index: int
    endpoint: str
    sub: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes] | None
    epoch: str | None = None
    """The publisher's epoch (connect layout: one address, one publisher)."""
    publisher_id: bytes | None = None
    """PR #57789: the id in the publisher's live seq frames (None: it sends none)."""
    bootstrap: bool = False
    """PR #57789: the next live message starts a snapshot bootstrap."""


@dataclass
class _ReplayAnswer:
    batches: list[tuple[bytes, int, bytes]]
    """(topic, seq, payload) of every batch the publisher sent back, in seq order."""
    status: PublisherStatus | None
    """What a kvconnect publisher said about itself; None from others or on failure."""
    complete: bool
    """The terminator arrived (False: timeout or socket error)."""


REPLAY_ATTEMPTS = 3
"""Replay requests in a row that may stall (nothing for `replay_timeout`) before what they
should have repaired is reported lost."""


def _check_sizes(start_seq: int | None, max_message_size: int) -> None:
    if start_seq is not None and start_seq < 0:
        raise ValueError(f"start_seq must be >= 0, got {start_seq}")
    if isinstance(max_message_size, bool) or not isinstance(max_message_size, int):
        raise ValueError(f"max_message_size must be an integer, got {max_message_size!r}")
    if max_message_size < 1:
        raise ValueError(f"max_message_size must be >= 1, got {max_message_size}")


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
        snapshots: bool = False,
        replay_timeout: float = 2.0,
        snapshot_endpoint: str | Sequence[str | None] | None = None,
        hwm: int = 100_000,
        max_message_size: int = MAX_BATCH_BYTES,
        curve: CurveClientKeys | None = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.endpoints = [endpoint] if isinstance(endpoint, str) else list(endpoint)
        if not self.endpoints:
            raise ValueError("endpoint: at least one endpoint is needed")
        self._replay_by_source, self._replay_by_rank = self._resolve_replay(replay_endpoint)
        self._snapshot_by_source = self._resolve_snapshots(snapshot_endpoint)
        _check_sizes(start_seq, max_message_size)
        self._start_seq = start_seq
        self._max_message_size = max_message_size
        self._topic = topic.encode()
        self._curve = curve
        self._snapshots = snapshots
        self._ctx = context or zmq.Context.instance()
        self._replay_timeout = replay_timeout
        self._bind = bind
        self._poller = zmq.Poller()
        self._sources: list[_Source] = []
        self._by_socket: dict[zmq.Socket[bytes], tuple[_Source, bool]] = {}
        self._dealers: dict[str, zmq.Socket[bytes]] = {}
        self._streams: dict[tuple[int, bytes, int | None], _Stream] = {}
        self._pending: deque[SubscriberItem] = deque()
        self._closed = False
        self._polling = False
        self._state_lock = threading.Lock()
        # close() from another thread wakes a waiting poll through this pipe: the poll needs
        # no timeout of its own (a reader woken 10 times a second took the GIL from the
        # router's event loop each time: its p99 latency)
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)
        self._poller.register(self._wake_read, zmq.POLLIN)
        self._zero_counts()
        self.connected: set[str] = set()
        """Endpoints whose publisher this subscriber has reached at least once."""
        self.handshaking = False
        """A handshake is under way (they run one at a time: the others' wait)."""
        self.last_handshake = 0.0
        """When the last handshake ended (time.monotonic)."""
        self.caught_up: set[str] = set()
        """Endpoints whose publisher's state this subscriber has queued whole at least once:
        a connection's handshake answered completely (its snapshot and replay, or a replay
        from `start_seq`). Once nothing is queued (`num_queued`), all of it was yielded."""
        self._unrepaired = False  # a loss reported since the last resync
        for i, ep in enumerate(self.endpoints):
            self._open(i, ep, hwm)

    def _zero_counts(self) -> None:
        self.num_bad_frames = 0
        self.num_decode_errors = 0
        self.num_gaps_repaired = 0
        self.num_batches_replayed = 0
        self.num_batches_lost = 0
        self.num_replay_failures = 0
        """Replay answers that stalled (no message for `replay_timeout`) or failed."""
        self.num_duplicates = 0
        self.num_handshakes = 0
        self.num_snapshots = 0
        self.num_bootstraps = 0
        """PR #57789 snapshots applied (first contact, a restart, a loss)."""

    def _resolve_snapshots(self, given: str | Sequence[str | None] | None) -> list[str | None]:
        """Per endpoint, its snapshot endpoint (PR #57789's; None: none)."""
        if given is None or isinstance(given, str):
            if isinstance(given, str) and len(self.endpoints) > 1:
                raise ValueError("snapshot_endpoint: give one per endpoint (a list)")
            return [given] * len(self.endpoints)
        if len(given) != len(self.endpoints):
            raise ValueError(
                f"snapshot_endpoint: {len(given)} given for {len(self.endpoints)} endpoints"
            )
        return list(given)

    def _open(self, index: int, endpoint: str, hwm: int) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, hwm)
        sub.setsockopt(zmq.MAXMSGSIZE, self._max_message_size)
        if self._curve is not None:
            self._curve.apply(sub)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        # Connected, each connection that comes up is one publisher: watch for it.
        monitor = None if self._bind else sub.get_monitor_socket(_MONITORED)
        source = _Source(index, endpoint, sub, monitor)
        self._sources.append(source)
        try:
            sub.bind(endpoint) if self._bind else sub.connect(endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise ValueError(
                f"cannot {'bind' if self._bind else 'connect'} {endpoint!r}: {e}"
            ) from e
        for sock, is_monitor in ((monitor, True), (sub, False)):
            if sock is not None:
                self._by_socket[sock] = (source, is_monitor)
                self._poller.register(sock, zmq.POLLIN)

    def _resolve_replay(
        self, replay: ReplayEndpoints
    ) -> tuple[list[str | None], Mapping[int, str] | None]:
        """The replay address of each endpoint, or (bind layout) of each DP rank: the union
        resolved once, so a gap looks its address up without dispatching on its type."""
        if isinstance(replay, Mapping):
            return [None] * len(self.endpoints), replay
        if replay is None or isinstance(replay, str):
            if isinstance(replay, str) and len(self.endpoints) > 1:
                raise ValueError(
                    "replay_endpoint: give one per endpoint (a list) or a rank mapping"
                )
            return [replay] * len(self.endpoints), None
        if len(replay) != len(self.endpoints):
            raise ValueError(
                f"replay_endpoint: {len(replay)} given for {len(self.endpoints)} endpoints"
            )
        return list(replay), None

    def _replay_for(self, source: int, rank: int | None) -> str | None:
        if self._replay_by_rank is None:
            return self._replay_by_source[source]
        return self._replay_by_rank.get(rank) if rank is not None else None

    # -- reading ------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[SubscriberItem]:
        while not self._closed:
            item = self.recv()
            if item is not None:
                yield item

    def recv(self, timeout: float | None = None) -> SubscriberItem | None:
        """The next item, or None if none arrived within `timeout` seconds (None: wait)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        expired = False
        while True:
            with self._state_lock:
                if self._closed:
                    # close() during a poll left the sockets to this thread: close them now,
                    # whatever that poll took (a monitor left open and unread blocks libzmq's
                    # I/O thread, which sends its events blocking: every socket of the
                    # context then stalls)
                    self._close_sockets()
                    return None
                if self._pending:
                    return self._pending.popleft()
                if expired:
                    return None
                self._polling = True
            try:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready = self._poller.poll(None if left is None else int(left * 1000))
                ready = [r for r in ready if r[0] != self._wake_read]  # close() is seen above
                # A connection's handshake comes before the live batches that follow it.
                for sock, _ in sorted(ready, key=lambda r: not self._by_socket[r[0]][1]):
                    source, is_monitor = self._by_socket[sock]
                    if is_monitor:
                        self._on_monitor(source, sock)
                        continue
                    # Take what is queued (one poll per burst, not per batch). A reconnect
                    # noticed after some of these is still safe: each stream's epoch check
                    # and gap repair do not depend on the handshake coming first.
                    self._on_live(source, sock.recv_multipart())
                    for _ in range(_DRAIN - 1):
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_live(source, frames)
            finally:
                with self._state_lock:
                    self._polling = False
            expired = not ready and deadline is not None and time.monotonic() >= deadline

    @property
    def num_queued(self) -> int:
        """Items received and not yet yielded."""
        return len(self._pending)

    def _on_monitor(self, source: _Source, sock: zmq.Socket[bytes]) -> None:
        event = parse_monitor_message(sock.recv_multipart())
        if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._handshake(source)
        elif event["event"] == zmq.EVENT_DISCONNECTED:
            # libzmq reconnects after a lost connection (it says so: CONNECT_RETRIED, right
            # after) but never after a protocol error (a frame over MAXMSGSIZE): then connect
            # again so the stream always comes back (what it missed is replayed, or reported
            # lost). Not otherwise: a disconnect() of a connection libzmq had already brought
            # back, its messages queued, aborted the process in libzmq (fq.cpp `!_more`).
            while sock.poll(_RECONNECT_NOTICE_MS):
                following = parse_monitor_message(sock.recv_multipart())["event"]
                if following == zmq.EVENT_CONNECT_RETRIED:
                    return
                if following == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._handshake(source)
                    return
            source.sub.disconnect(source.endpoint)
            source.sub.connect(source.endpoint)

    def _handshake(self, source: _Source) -> None:
        """A connection to the publisher at `source` is up: learn who it is and catch up."""
        self.handshaking = True
        try:
            self._catch_up(source)
        finally:
            self.handshaking = False
            self.last_handshake = time.monotonic()

    def _catch_up(self, source: _Source) -> None:
        self.connected.add(source.endpoint)
        streams = [st for st in self._streams.values() if st.source == source.index]
        if self._bootstraps(source) and all(st.last_seq is None for st in streams):
            source.bootstrap = True  # PR #57789: on the first live message (`_on_live`)
            return
        replay = self._replay_for(source.index, None)
        if replay is None:
            self.caught_up.add(source.endpoint)  # live only: nothing to catch up with
            return
        self.num_handshakes += 1
        streams = [st for st in self._streams.values() if st.source == source.index]
        for st in streams:
            st.dup_until = -1  # a new connection: only this answer can duplicate live batches
        known = [st.last_seq for st in streams if st.last_seq is not None]
        if not known and self._snapshots:
            fence = self._snapshot(source, replay)
            known = [] if fence is None else [fence]
        if known:
            start = min(known) + 1
        else:
            start = _PROBE_SEQ if self._start_seq is None else self._start_seq
        answer = self._request_replay(replay, start)
        status = answer.status
        if status is not None and source.epoch is not None and status.epoch != source.epoch:
            answer = self._request_replay(replay, 0)
            status = answer.status
            resume = answer.batches[0][1] if answer.batches else status.next_seq if status else 0
            for st in streams:
                self._restarted(st, resume)
        if status is not None:
            source.epoch = status.epoch
        for topic, seq, payload in answer.batches:
            batch = self._decode(payload, seq)
            if batch is None:
                continue
            stream = self._stream(source.index, topic, batch.data_parallel_rank)
            if stream.last_seq is not None and seq <= stream.last_seq:
                continue
            # What was asked for and is not there (the ring dropped it) is lost.
            expected = start if stream.last_seq is None else stream.last_seq + 1
            if start != _PROBE_SEQ and seq > expected:
                self._lost(stream, expected, seq - 1)
            self._pending.append(ReceivedBatch(seq, batch, stream.id))
            self.num_batches_replayed += 1
            stream.last_seq = stream.dup_until = seq
        lost = self._unrepaired
        if self._resync(source, replay) or (answer.complete and not lost):
            self.caught_up.add(source.endpoint)

    def _resync(self, source: _Source, replay: str | None, topic: bytes | None = None) -> bool:
        """After losses replay could not repair (`_lost`), the publisher's snapshot, queued
        after everything the repair yielded (with `snapshots=True`); whether one came. A
        PR #57789 snapshot service is asked first, then kvconnect's replay socket."""
        resynced = False
        if self._unrepaired and self._snapshots:
            if self._bootstraps(source):
                if topic is None:
                    topic = next(
                        (
                            st.id.topic.encode()
                            for st in self._streams.values()
                            if st.source == source.index
                        ),
                        self._topic,
                    )
                resynced = self._bootstrap(source, topic) is not None
            if not resynced and replay is not None:
                resynced = self._snapshot(source, replay) is not None
        self._unrepaired = False
        return resynced

    def _bootstraps(self, source: _Source) -> bool:
        return self._snapshots and self._snapshot_by_source[source.index] is not None

    def _bootstrap(self, source: _Source, topic: bytes) -> int | None:
        """PR #57789: the publisher's snapshot, queued as a `StreamSnapshot` of the stream of
        `topic` (the answer names no topic: the live message's), which resumes after its seq;
        the seq, or None if none came (unavailable, another publisher id, no answer)."""
        endpoint = self._snapshot_by_source[source.index]
        assert endpoint is not None
        frames = self._request(endpoint, [b"", b"snapshot"])
        if frames is None or len(frames) < 2 or len(frames[0]) != 8:
            return None
        seq = int.from_bytes(frames[0], "big", signed=True)
        if seq < SNAPSHOT_NONE:
            logger.warning("KV event subscriber: %s: snapshot unavailable (%d)", endpoint, seq)
            return None
        if source.publisher_id is not None and frames[1] != source.publisher_id:
            return None  # a restart in between: its live messages will say so
        source.publisher_id = frames[1]
        batches = [self._decode(payload, seq) for payload in frames[2:]]
        if any(b is None for b in batches):
            return None  # a snapshot is whole or not at all
        events = [e for b in batches if b is not None for e in b.events]
        rank = batches[0].data_parallel_rank if batches and batches[0] else None
        stream = self._stream(source.index, topic, rank)
        self._pending.append(
            StreamSnapshot(stream.id, seq, KVEventBatch(time.time(), events, rank))
        )
        self.num_snapshots += 1
        self.num_bootstraps += 1
        stream.last_seq = None if seq == SNAPSHOT_NONE else seq
        stream.dup_until = seq
        return seq

    def _request(self, endpoint: str, request: list[bytes]) -> list[bytes] | None:
        """One request and its one-message answer on a DEALER (its envelope removed); None
        after `replay_timeout` without it."""
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_size)
            if self._curve is not None:
                self._curve.apply(sock)
            sock.connect(endpoint)
            sock.send_multipart(request)
            if not sock.poll(int(self._replay_timeout * 1000)):
                self.num_replay_failures += 1
                logger.warning("KV event subscriber: no snapshot from %s", endpoint)
                return None
            frames: list[bytes] = sock.recv_multipart()
            return frames[1:] if frames[:1] == [b""] else frames
        except zmq.ZMQError as e:
            self.num_replay_failures += 1
            logger.warning("KV event subscriber: snapshot from %s failed: %s", endpoint, e)
            return None
        finally:
            sock.close(linger=0)

    def _snapshot(self, source: _Source, replay: str) -> int | None:
        """Ask the publisher at `replay` for its state and queue it as `StreamSnapshot`s (one
        per stream it answers for); the fence seq, or None if it gave none. The streams resume
        after the fence."""
        answer = self._request_replay(replay, SNAPSHOT_REQUEST)
        if answer.status is None or not answer.complete or not answer.batches:
            return None  # not a kvconnect publisher (or no answer): replay alone
        if source.epoch is not None and answer.status.epoch != source.epoch:
            return None  # a restart in between: the next handshake or live batch sees it
        source.epoch = answer.status.epoch
        merged: dict[tuple[bytes, int | None], tuple[int, KVEventBatch]] = {}
        for topic, seq, payload in answer.batches:
            batch = self._decode(payload, seq)
            if batch is None:
                return None  # a snapshot is whole or not at all
            key = (topic, batch.data_parallel_rank)
            if key in merged:
                merged[key][1].events.extend(batch.events)
            else:
                merged[key] = (seq, batch)
        fence = -1
        for (topic, rank), (seq, batch) in merged.items():
            stream = self._stream(source.index, topic, rank)
            if stream.last_seq is not None and seq < stream.last_seq:
                continue  # older than what we have
            self._pending.append(StreamSnapshot(stream.id, seq, batch))
            self.num_snapshots += 1
            stream.last_seq = stream.dup_until = seq
            fence = max(fence, seq)
        return fence if fence >= 0 else None

    def _restarted(self, stream: _Stream, first_seq: int) -> None:
        self._pending.append(PublisherRestarted(stream.id, stream.last_seq or 0, first_seq))
        stream.last_seq, stream.dup_until = None, -1

    def _on_live(self, source: _Source, frames: list[bytes]) -> None:
        parsed = split_seq_frame(frames[1]) if len(frames) == 3 else None
        if parsed is None:
            self.num_bad_frames += 1
            logger.warning(
                "KV event subscriber: skipped a message of %d frames that is not "
                "[topic, seq(8 or 24 bytes), payload]",
                len(frames),
            )
            return
        topic, _, payload = frames
        seq, publisher_id = parsed
        batch = self._decode(payload, seq)
        if batch is None:
            return
        stream = self._stream(source.index, topic, batch.data_parallel_rank)
        if publisher_id is not None and publisher_id != source.publisher_id:
            if source.publisher_id is not None:  # PR #57789: a new id is a new publisher
                for st in [st for st in self._streams.values() if st.source == source.index]:
                    if st.last_seq is not None:
                        self._restarted(st, seq)
                source.bootstrap = self._bootstraps(source)
            source.publisher_id = publisher_id
        if source.bootstrap:
            source.bootstrap = False
            self._bootstrap(source, topic)
            self.caught_up.add(source.endpoint)
        last = stream.last_seq
        if last is None:
            if self._start_seq is not None and seq > self._start_seq:
                self._fill(source, stream, self._start_seq, seq)
        elif seq <= last:
            if seq <= stream.dup_until or not self._is_restart(source, stream):
                self.num_duplicates += 1
                return
            self._restarted(stream, seq)
            if seq > 0:
                self._fill(source, stream, 0, seq)
        elif seq > last + 1:
            self._fill(source, stream, last + 1, seq)
        if stream.last_seq is not None and stream.last_seq >= seq:  # a snapshot covered it
            self.num_duplicates += 1
            return
        self._pending.append(ReceivedBatch(seq, batch, stream.id))
        stream.last_seq = seq

    def _identity(self, source: _Source, stream: _Stream) -> _Source | _Stream:
        """Where the epoch of `stream`'s publisher is kept."""
        return stream if self._bind else source

    def _is_restart(self, source: _Source, stream: _Stream) -> bool:
        """A seq went back outside a handshake's replay: a new publisher, unless the one we know
        says it is still itself (then the batch is a late duplicate)."""
        replay = self._replay_for(source.index, stream.id.data_parallel_rank)
        owner = self._identity(source, stream)
        if replay is None or owner.epoch is None:
            return True
        status = self._request_replay(replay, _PROBE_SEQ).status
        if status is None:
            return True
        restarted = status.epoch != owner.epoch
        owner.epoch = status.epoch
        return restarted

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

    def _fill(self, source: _Source, stream: _Stream, first: int, end: int) -> None:
        """Queue batches [first, end) of `stream` from replay, and `EventsLost` for the rest.
        An answer from a publisher with another epoch means it restarted: report that and read
        the new one from 0 instead."""
        replay = self._replay_for(source.index, stream.id.data_parallel_rank)
        answer = self._request_replay(replay, first) if replay else None
        status = answer.status if answer is not None else None
        if status is not None:
            owner = self._identity(source, stream)
            if owner.epoch is not None and status.epoch != owner.epoch and first > 0:
                owner.epoch = status.epoch
                self._restarted(stream, end)
                self._fill(source, stream, 0, end)
                return
            owner.epoch = status.epoch
        expected = first
        for _, seq, payload in answer.batches if answer is not None else ():
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
        self._resync(source, replay, stream.id.topic.encode())

    def _lost(self, stream: _Stream, first: int, last: int) -> None:
        self.num_batches_lost += last - first + 1
        self._unrepaired = True
        logger.warning("KV event subscriber: %s lost batches %d..%d", stream.id, first, last)
        self._pending.append(EventsLost(stream.id, first, last))

    def _request_replay(self, endpoint: str, start_seq: int | bytes) -> _ReplayAnswer:
        """Every batch the publisher still holds from `start_seq` on, and its status (or, for
        SNAPSHOT_REQUEST, its snapshot). The deadline is on progress: an answer that stalls
        for `replay_timeout` is asked for again from the next seq, so it ends only when
        complete or when the publisher sends nothing for REPLAY_ATTEMPTS deadlines in a row.
        A stall is not a loss: a publisher busy with a flood of other sessions may take
        longer than one deadline to send its first message, and what is reported lost makes
        a router forget the instance's index."""
        answer = self._replay_once(endpoint, start_seq)
        stalls = 0 if answer.batches else 1
        batches = isinstance(start_seq, int) and start_seq != _PROBE_SEQ  # not a status probe
        while not answer.complete and batches and stalls < REPLAY_ATTEMPTS:
            next_seq = answer.batches[-1][1] + 1 if answer.batches else start_seq
            more = self._replay_once(endpoint, next_seq)
            stalls = 0 if more.batches else stalls + 1
            answer.batches.extend(more.batches)
            answer.status, answer.complete = more.status, more.complete
        return answer

    def _replay_once(self, endpoint: str, start_seq: int | bytes) -> _ReplayAnswer:
        sock = self._dealers.get(endpoint)
        if sock is None:
            sock = self._dealers[endpoint] = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_size)
            if self._curve is not None:
                self._curve.apply(sock)
            sock.connect(endpoint)
        answer = _ReplayAnswer([], None, False)
        try:
            request = start_seq if isinstance(start_seq, bytes) else start_seq.to_bytes(8, "big")
            sock.send_multipart((b"", request), flags=zmq.NOBLOCK)
            while True:
                # A busy publisher answers a slice at a time: wait for progress, not for all.
                if not sock.poll(int(self._replay_timeout * 1000)):
                    raise TimeoutError(f"the replay answer stalled for {self._replay_timeout}s")
                frames = sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if not frames or frames[-1] == b"":
                    # The terminator: v1 [END_SEQ, b""], v2 [b"", END_SEQ, b""], kvconnect's
                    # [status, END_SEQ, b""].
                    if len(frames) == 3 and frames[1] == END_SEQ:
                        answer.status = PublisherStatus.decode(frames[0])
                    answer.complete = True
                    return answer
                # v2 answers carry the topic first, v1 answers do not.
                if len(frames) in (2, 3) and len(frames[-2]) == 8:
                    topic = frames[0] if len(frames) == 3 else b""
                    answer.batches.append((topic, int.from_bytes(frames[-2], "big"), frames[-1]))
                else:
                    self.num_bad_frames += 1
        except (zmq.ZMQError, TimeoutError) as e:
            self.num_replay_failures += 1
            logger.warning("KV event subscriber: replay from %s failed: %s", endpoint, e)
            # Late answers would be mistaken for the next request's: start a fresh socket.
            self._dealers.pop(endpoint).close(linger=0)
            return answer

    def close(self) -> None:
        """Close every socket; iteration ends. Idempotent. Safe from another thread: the
        reading thread, woken, then closes the sockets."""
        with self._state_lock:
            if self._closed and not self._polling:
                return
            self._closed = True
            if not self._polling:
                self._close_sockets()
            else:
                with contextlib.suppress(BlockingIOError):
                    os.write(self._wake_write, b"x")

    def _close_sockets(self) -> None:
        """Once (under `_state_lock`): close() may have done it while the reader was between
        polls, and the pipe's numbers may since be another socket's."""
        if self._wake_read < 0:
            return
        for source in self._sources:
            if source.monitor is not None:
                source.sub.disable_monitor()
                source.monitor.close(linger=0)
            source.sub.close(linger=0)
        for sock in self._dealers.values():
            sock.close(linger=0)
        self._sources.clear()
        self._by_socket.clear()
        self._dealers.clear()
        os.close(self._wake_read)
        os.close(self._wake_write)
        self._wake_read = self._wake_write = -1

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
    "StreamSnapshot",
    "SubscriberItem",
]
