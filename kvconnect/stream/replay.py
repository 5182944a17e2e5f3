"""The publisher's replay server: answers replay and snapshot requests on its own thread.

Owned by `ZmqEventPublisher`, which appends every published batch to the shared `ReplayRing`
and hands it to `observe()`; this thread keeps the stream's state (`state.StreamState`) from
those batches and serves a ROUTER socket (wire: `wire.py`).

Service is bounded and fair. Every request becomes a session answered a slice at a time,
round-robin, with non-blocking sends on a small per-client queue (REPLAY_CLIENT_HWM messages
and a fixed kernel buffer). A round's budget is shared by the sessions whose clients are not
blocked, so each gets its turn every few milliseconds however many there are. A client whose
queue is full is blocked: it is tried again after a backoff that grows to half a second, so a
crowd that reads nothing costs a few failed sends each a second and never delays a client that
reads. What a client that never reads can absorb before it is blocked is its socket buffers
(about 250 KB here: ~700 small batches), so the work a crowd causes is bounded by its size
times that, and a reader gets an equal share meanwhile (measured in
tests/faults/test_replay_flood.py: 1,000 such clients, a 10,000-batch replay arrives whole).

A session that makes no progress for REPLAY_STALL_S is dropped. A new request from the same
client replaces its answer but keeps its record (progress, blocked, backoff): asking again
does not make a client look fresh. At MAX_REPLAY_SESSIONS a new client replaces the session
blocked the longest (for REPLAY_EVICTABLE_S at least), else it waits in a bounded FIFO: a
client that reads is never pushed out by newcomers. Memory stays within the ring, one shared
copy of the snapshot per seq, and per client its queue (batches over REPLAY_COPY_THRESHOLD
are queued zero-copy: the ring's own bytes).

Snapshots: a snapshot request is answered with every block the stream says is held, per medium,
as BlockStored events in batches that all carry the seq they are current at (the fence). A
consumer drops what it knew of the stream, applies the snapshot, then every batch after the
fence. A malformed request gets the terminator alone, so no client waits forever.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from queue import Empty, SimpleQueue
from typing import Any, NamedTuple

import zmq

from kvconnect.events import BlockStored, KVEventBatch, encode_batch
from kvconnect.stream.state import StreamState
from kvconnect.stream.wire import END_SEQ, MAX_REQUEST_BYTES, SNAPSHOT_REQUEST, PublisherStatus

logger = logging.getLogger(__name__)

REPLAY_SLICE = 256
"""Messages a session may send per round, at most."""
REPLAY_ROUND_BUDGET = 2048
"""Messages per round, shared by the sessions that are not blocked: each gets this divided by
their number (at least 1, at most REPLAY_SLICE), so a round takes a few milliseconds however
many clients there are, and a client that reads gets its share every round."""
REPLAY_CLIENT_HWM = 64
"""Messages queued per replay client before its sends fail (it is blocked, and skipped)."""
REPLAY_CLIENT_SNDBUF = 1 << 16
"""Kernel send buffer per replay connection, bytes."""
REPLAY_COPY_THRESHOLD = 4096
"""Frames up to this size are copied into the client's queue; larger ones are sent zero-copy,
sharing the ring's bytes, so what waits for clients that do not read is at most
REPLAY_CLIENT_HWM x this per client, whatever the batch size."""
REPLAY_STALL_S = 10.0
"""A session with no send accepted for this long is dropped."""
REPLAY_BACKOFF_S = (0.002, 0.5)
"""A blocked session is tried again after the first delay, doubled at each blocked try up to
the second: a client that reads drains its queue in milliseconds and is served again at
once, while a crowd that reads nothing costs about two failed sends per client a second."""
REPLAY_EVICTABLE_S = 1.0
"""A session blocked this long may make room for a new client."""
MAX_REPLAY_SESSIONS = 1024
"""Sessions served at once. A new client beyond it replaces the session blocked the longest
(for at least REPLAY_EVICTABLE_S: its client reads nothing); else it waits for a free one."""
MAX_WAITING_REQUESTS = 4096
"""Requests waiting for a session; beyond it the oldest one waiting is dropped."""
SNAPSHOT_EVENTS_PER_BATCH = 1024
SNAPSHOT_TOKENS_PER_BATCH = 1 << 20
"""A snapshot batch ends after this many token ids and block hashes (about 5 MiB of msgpack),
so it stays far below the subscriber's `wire.MAX_BATCH_BYTES` whatever its events hold."""


def _snapshot_chunks(events: list[BlockStored]) -> list[list[Any]]:
    """`events` cut into batches of at most SNAPSHOT_EVENTS_PER_BATCH events and (but for a
    single larger event) SNAPSHOT_TOKENS_PER_BATCH token ids and hashes; one batch at least."""
    chunks: list[list[Any]] = [[]]
    size = 0
    for event in events:
        n = len(event.token_ids) + len(event.block_hashes)
        if chunks[-1] and (
            len(chunks[-1]) >= SNAPSHOT_EVENTS_PER_BATCH or size + n > SNAPSHOT_TOKENS_PER_BATCH
        ):
            chunks.append([])
            size = 0
        chunks[-1].append(event)
        size += n
    return chunks


class ReplayRing:
    """The last `capacity` published batches as (seq, seq bytes, payload), under one lock
    held only for an append or a slice (the publisher appends; the replay thread slices)."""

    def __init__(self, capacity: int) -> None:
        self.lock = threading.Lock()
        self.entries: deque[tuple[int, bytes, bytes]] = deque(maxlen=capacity)

    def slice(
        self, start_seq: int, end_seq: int, limit: int
    ) -> tuple[int, list[tuple[int, bytes, bytes]]]:
        """(the oldest seq held, up to `limit` entries with start_seq <= seq < end_seq)."""
        with self.lock:
            ring = self.entries
            first = ring[0][0] if ring else end_seq
            lo = max(start_seq, first) - first
            hi = min(end_seq - first, lo + limit, len(ring))
            return first, [ring[i] for i in range(lo, hi)] if lo < hi else []


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
    retry_at: float = 0.0
    """Blocked: not tried again before this time."""
    num_blocked: int = 0
    """Tries in a row that sent nothing."""


class _Slice(NamedTuple):
    """What one turn of a session sent."""

    num_sent: int
    done: bool
    """The terminator went: the answer is complete."""
    blocked: bool
    """The client's queue is full: it reads slower than it is sent to, or not at all."""


def open_replay_socket(ctx: zmq.Context[zmq.Socket[bytes]]) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.ROUTER)
    # Only requests arrive here: a bigger frame drops its sender before it is read.
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
    sock.setsockopt(zmq.SNDHWM, REPLAY_CLIENT_HWM)
    # A fixed kernel buffer (no autotuning to megabytes): a client that does not read can
    # absorb only this much before its sends fail.
    sock.setsockopt(zmq.SNDBUF, REPLAY_CLIENT_SNDBUF)
    # A send to a full or departed client fails instead of being dropped silently.
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.copy_threshold = REPLAY_COPY_THRESHOLD
    return sock


class ReplayServer:
    """Serves `ring` and the stream's state on `sock` (bound by the caller) until `stop()`."""

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        ring: ReplayRing,
        status: Callable[[], PublisherStatus],
        topic: bytes,
        data_parallel_rank: int,
    ) -> None:
        self._sock = sock
        self._ring = ring
        self._status = status
        self._topic = topic
        self._data_parallel_rank = data_parallel_rank
        self._published: SimpleQueue[tuple[int, KVEventBatch]] = SimpleQueue()
        self._stop = threading.Event()
        self.state = StreamState()
        """What the stream says is held (kept by the replay thread; read it only there or
        after stop)."""
        self.num_requests = 0
        self.num_snapshots = 0
        self.num_sessions_dropped = 0
        self._sessions: dict[bytes, _Session] = {}
        self._blocked: dict[bytes, float] = {}
        """Sessions whose client's queue is full -> since when, the longest blocked first."""
        self._waiting: dict[bytes, list[bytes]] = {}
        """Requests waiting for a session, the oldest first."""
        self._snapshot_cache: tuple[int, tuple[tuple[bytes, bytes], ...]] | None = None
        """(seq, the snapshot's messages as of it)."""
        self._thread = threading.Thread(target=self._loop, name="kv-events-replay", daemon=True)
        self._thread.start()

    @property
    def num_blocked(self) -> int:
        """Sessions whose client's queue is full, as of the last round (any thread)."""
        return len(self._blocked)

    def observe(self, seq: int, batch: KVEventBatch) -> None:
        """A batch was published as `seq` (any thread; the state is updated on this one)."""
        self._published.put((seq, batch))

    def stop(self, timeout: float = 1.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _loop(self) -> None:
        sock = self._sock
        try:
            while not self._stop.is_set():
                self._apply_state()
                busy = self._serve_round()
                # Idle, or every client blocked: wait for requests a moment, else go on.
                if sock.poll(0 if busy else 5 if self._sessions else 50):
                    for _ in range(256):  # take what is there, then serve again
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._request(frames)
                self._admit_waiting()
        finally:
            sock.close(linger=0)

    def _apply_state(self) -> None:
        queue, state = self._published, self.state
        while True:
            try:
                seq, batch = queue.get_nowait()
            except Empty:
                return
            state.apply(seq, batch)

    def _snapshot(self, identity: bytes, now: float) -> _Session:
        self._apply_state()
        self.num_snapshots += 1
        state = self.state
        cached = self._snapshot_cache
        if cached is None or cached[0] != state.seq:
            # Encoded once per seq: a crowd asking for snapshots shares one copy.
            fence = max(0, state.seq).to_bytes(8, "big")
            # Nothing published yet: no snapshot (replay from 0 is the whole stream). Else at
            # least one batch, which names the stream (topic, rank) even when it holds nothing.
            chunks = [] if state.seq < 0 else _snapshot_chunks(state.events())
            rank = self._data_parallel_rank
            parts = tuple((fence, encode_batch(KVEventBatch(time.time(), c, rank))) for c in chunks)
            cached = self._snapshot_cache = (state.seq, parts)
        answered = PublisherStatus(self._status().epoch, state.seq + 1)
        return _Session(identity, 0, 0, answered.encode(), deque(cached[1]), now)

    def _session(self, frames: list[bytes], now: float) -> _Session:
        identity = frames[0]
        if len(frames) == 3 and frames[1] == b"" and frames[2] == SNAPSHOT_REQUEST:
            return self._snapshot(identity, now)
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            logger.warning(
                "KV event replay: malformed request (%d frames); sent terminator", len(frames)
            )
            return _Session(identity, 0, 0, self._status().encode(), None, now)
        start_seq = int.from_bytes(frames[2], "big")
        status = self._status()
        return _Session(identity, start_seq, status.next_seq, status.encode(), None, now)

    def _request(self, frames: list[bytes]) -> None:
        """A request: a session now, or (every session busy with a client that reads) a turn
        in the waiting queue. A client's new request replaces its earlier one."""
        identity = frames[0]
        self.num_requests += 1
        now = time.monotonic()
        self._waiting.pop(identity, None)
        old = self._sessions.get(identity)
        if old is not None:
            # Its new answer keeps the client's record (progress, blocked, backoff): asking
            # again and again does not make a client that reads nothing look fresh.
            session = self._session(frames, now)
            session.last_progress, session.retry_at = old.last_progress, old.retry_at
            session.num_blocked = old.num_blocked
            self._sessions[identity] = session
            return
        if len(self._sessions) >= MAX_REPLAY_SESSIONS:
            victim = next(iter(self._blocked.items()), None)
            if victim is None or now - victim[1] < REPLAY_EVICTABLE_S:
                self._wait(identity, frames)
                return
            self._end(victim[0])
            self._dropped(
                "more than %d replay clients at once: the one blocked longest",
                MAX_REPLAY_SESSIONS,
            )
        self._sessions[identity] = self._session(frames, now)

    def _wait(self, identity: bytes, frames: list[bytes]) -> None:
        if len(self._waiting) >= MAX_WAITING_REQUESTS:
            del self._waiting[next(iter(self._waiting))]
            self._dropped("more than %d replay requests waiting: the oldest", MAX_WAITING_REQUESTS)
        self._waiting[identity] = frames

    def _admit_waiting(self) -> None:
        now = time.monotonic()
        while self._waiting and len(self._sessions) < MAX_REPLAY_SESSIONS:
            identity = next(iter(self._waiting))
            self._sessions[identity] = self._session(self._waiting.pop(identity), now)

    def _end(self, identity: bytes) -> None:
        del self._sessions[identity]
        self._blocked.pop(identity, None)

    def _dropped(self, why: str, arg: float) -> None:
        """Count a dropped session; log the first and then one in every 1,000."""
        self.num_sessions_dropped += 1
        n = self.num_sessions_dropped
        if n == 1 or n % 1000 == 0:
            logger.warning("KV event replay: " + why + "; dropped it (%d so far)", arg, n)

    def _serve_round(self) -> bool:
        """A turn of every session not backing off; whether any send went through."""
        sessions = self._sessions
        num_reading = max(1, len(sessions) - len(self._blocked))
        limit = max(1, min(REPLAY_SLICE, REPLAY_ROUND_BUDGET // num_reading))
        progressed = False
        now = time.monotonic()
        for session in list(sessions.values()):
            if session.retry_at > now:
                continue
            try:
                turn = self._serve_slice(session, limit)
            except zmq.ZMQError as e:  # EHOSTUNREACH: the client went away
                self._end(session.identity)
                if e.errno != zmq.EHOSTUNREACH:
                    logger.warning("KV event replay: send failed: %s", e)
                continue
            if turn.num_sent or turn.done:
                progressed = True
                session.last_progress = now
            if turn.done:
                self._end(session.identity)
            elif now - session.last_progress > REPLAY_STALL_S:
                self._end(session.identity)
                self._dropped("a replay client read nothing for %.0fs", REPLAY_STALL_S)
            else:
                self._after_turn(session, turn, now)
        return progressed

    def _after_turn(self, session: _Session, turn: _Slice, now: float) -> None:
        """Keep the blocked table and the session's backoff (REPLAY_BACKOFF_S) up to date."""
        identity, blocked = session.identity, self._blocked
        if turn.num_sent:
            blocked.pop(identity, None)  # it read: blocked again, it goes to the back
            session.num_blocked = 0
        if not turn.blocked:
            return
        blocked.setdefault(identity, now)
        first, most = REPLAY_BACKOFF_S
        session.retry_at = now + min(most, first * (1 << min(session.num_blocked, 16)))
        session.num_blocked += 1

    def _serve_slice(self, session: _Session, limit: int) -> _Slice:
        """Send up to `limit` messages of `session`'s answer, non-blocking."""
        ident, topic, sent = session.identity, self._topic, 0
        send, flags = partial(self._sock.send_multipart, copy=False), zmq.NOBLOCK
        try:
            if session.parts is not None:
                parts = session.parts
                while parts and sent < limit:
                    seq_bytes, payload = parts[0]
                    send((ident, b"", topic, seq_bytes, payload), flags)
                    parts.popleft()
                    sent += 1
                if parts:
                    return _Slice(sent, False, False)
            else:
                first, entries = self._ring.slice(session.next_seq, session.end_seq, limit)
                # Batches the ring dropped meanwhile are skipped: the client sees the gap.
                session.next_seq = max(session.next_seq, first)
                for seq, seq_bytes, payload in entries:
                    send((ident, b"", topic, seq_bytes, payload), flags)
                    session.next_seq = seq + 1
                    sent += 1
                if session.next_seq < session.end_seq and entries:
                    return _Slice(sent, False, False)
            # The next seq as of the request: every batch before it was in this answer or live.
            send((ident, b"", session.status, END_SEQ, b""), flags)
            return _Slice(sent, True, False)
        except zmq.Again:
            return _Slice(sent, False, True)
