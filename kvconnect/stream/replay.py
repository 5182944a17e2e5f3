"""The publisher's replay server: answers replay and snapshot requests on its own thread.

Owned by `ZmqEventPublisher`, which appends every published batch to the shared `ReplayRing`
and hands it to `observe()`; this thread keeps the stream's state (`state.StreamState`) from
those batches and serves a ROUTER socket (wire: `wire.py`).

Service is bounded and fair. Every request becomes a session answered a slice at a time,
round-robin, with non-blocking sends on a small per-client queue (REPLAY_CLIENT_HWM messages,
a fixed kernel buffer). A round's budget is shared by the ready sessions, each gets its turn
once a round. A session whose client's queue is full is parked: out of the rounds, nothing more
sent or copied for it, tried again (one message) after a jittered backoff growing to half a
second. What a client that never reads absorbs before it is parked is its socket buffers, so
the work a crowd causes is bounded by its size times that; a reader gets an equal share
meanwhile, and one whose queue filled for a moment is tried again within a millisecond.

Why parking: a subscriber gives up an answer that sends it nothing for its `replay_timeout`
(2 s), and what its gap repair then misses is reported lost, though the ring holds it. A
reader's next message waits for one round, so rounds must stay short whatever a crowd does:
parked sessions wait in a heap by retry time (not visited each round), a try costs one send
and no ring slice, at most REPLAY_TRIES_PER_ROUND tries share a round, and jittered retry
times keep a crowd parked together from coming back all at once. (Before, blocked sessions
stayed in the rounds, each retry sliced up to 256 entries, and a crowd's retries fell due
together: beside 1,000 clients, on a core shared with two busy processes, a reader waited up
to 1.7 s for its next message; now up to 0.5 s.) tests/faults/test_replay_flood.py: 1,000
clients ask twice each and read nothing; a 10,000-batch replay arrives whole, nothing lost.

Memory per client that reads nothing: its full queue, at most REPLAY_CLIENT_HWM messages each
a copy of at most REPLAY_COPY_THRESHOLD bytes (bigger frames are the ring's own bytes):
MAX_QUEUED_BYTES_PER_BLOCKED_CLIENT, 64 KiB per blocked client, 64 MiB in all at
MAX_REPLAY_SESSIONS. A new request from a parked client replaces its answer and stays parked:
nothing more is queued. On top comes what libzmq keeps per connection whoever the client is
(pipe chunks, stream buffers: 50-80 KB measured once traffic has passed). Beyond these, the
ring and one shared snapshot copy per seq.

A session that makes no progress for REPLAY_STALL_S is dropped. A new request from the same
client replaces its answer but keeps its record (progress, blocked, backoff): asking again
does not make a client look fresh. At MAX_REPLAY_SESSIONS a new client replaces the session
blocked the longest (for REPLAY_EVICTABLE_S at least), else it waits in a bounded FIFO: a
client that reads is never pushed out by newcomers.

Snapshots: a snapshot request is answered with every block the stream says is held, per medium,
as BlockStored events in batches that all carry the seq they are current at (the fence). A
consumer drops what it knew of the stream, applies the snapshot, then every batch after the
fence. A malformed request gets the terminator alone, so no client waits forever.
"""

from __future__ import annotations

import heapq
import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from queue import Empty
from typing import Any, NamedTuple

import zmq

from kvconnect.events import BlockStored, KVEventBatch, encode_batch
from kvconnect.stream.state import StateServer
from kvconnect.stream.wire import END_SEQ, MAX_REQUEST_BYTES, SNAPSHOT_REQUEST, PublisherStatus

logger = logging.getLogger(__name__)

REPLAY_SLICE = 256
"""Messages a session may send per round, at most."""
REPLAY_ROUND_BUDGET = 1024
"""Messages per round, shared by the ready sessions: each gets this divided by their number
(at least 1, at most REPLAY_SLICE), so a round is about this many sends however many clients
there are (one each beyond it), and a client that reads gets its share every round."""
REPLAY_CLIENT_HWM = 16
"""Messages queued per replay client before its sends fail (it is parked): what a client that
reads nothing keeps queued (64 before: ~190 KB each of 2.9 KB batches); a reader drains it in
well under a millisecond."""
REPLAY_CLIENT_SNDBUF = 1 << 14
"""Kernel send buffer per replay connection, bytes (Linux doubles it): with the client's
receive buffer, what a client that reads nothing absorbs before it is parked. 16 KiB: a lone
reader replays 10,000 batches in 0.5 s as with 64 KiB, while 1,000 clients that never read
absorb ~100 small batches each, not ~280 (a reader beside them: 1.0 s, not 7.5 s)."""
REPLAY_COPY_THRESHOLD = 4096
"""Frames up to this size are copied into the client's queue; larger ones are sent zero-copy,
sharing the ring's bytes, so what waits for clients that do not read is at most
REPLAY_CLIENT_HWM x this per client, whatever the batch size."""
MAX_QUEUED_BYTES_PER_BLOCKED_CLIENT = REPLAY_CLIENT_HWM * REPLAY_COPY_THRESHOLD
"""Copies queued for a parked client, at most: 64 KiB (libzmq's connection buffers aside)."""
REPLAY_STALL_S = 10.0
"""A session with no send accepted for this long is dropped."""
REPLAY_BACKOFF_S = (0.0002, 0.5)
"""A parked session is tried again after the first delay, doubled at each blocked try up to
the second, times a random factor in [0.5, 1.5): a reader drains its queue in a fraction of a
millisecond and is served again at once; a client that reads nothing costs two tries a second."""
REPLAY_TRIES_PER_ROUND = 128
"""Parked sessions tried in one round, at most (each try: one failed send, ~10 us)."""
REPLAY_IDLE_WAIT_MS = 50
"""With nothing to send and no parked session due sooner, the loop waits this long for a
request."""
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


def snapshot_chunks(events: list[BlockStored]) -> list[list[Any]]:
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
    """Parked: not tried again before this time."""
    num_blocked: int = 0
    """Tries in a row that ended with the client's queue full (0: ready, not parked)."""


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


class ReplayServer(StateServer):
    """Serves `ring` and the stream's state on `sock` (bound by the caller) until `stop()`."""

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        ring: ReplayRing,
        status: Callable[[], PublisherStatus],
        topic: bytes,
        data_parallel_rank: int,
    ) -> None:
        super().__init__(sock, "kv-events-replay")
        self._ring = ring
        self._status = status
        self._topic = topic
        self._data_parallel_rank = data_parallel_rank
        self.num_requests = 0
        self.num_snapshots = 0
        self.num_sessions_dropped = 0
        self._sessions: dict[bytes, _Session] = {}
        self._ready: dict[bytes, None] = {}
        """The sessions served each round, in turn order; the others are parked."""
        self._parked: list[tuple[float, bytes]] = []
        """Heap of (retry time, identity) of parked sessions; an entry whose session ended or
        was tried since is skipped when it comes up."""
        self._blocked: dict[bytes, float] = {}
        """Sessions whose client's queue is full -> since when, the longest blocked first."""
        self._waiting: dict[bytes, list[bytes]] = {}
        """Requests waiting for a session, the oldest first."""
        self._snapshot_cache: tuple[int, tuple[tuple[bytes, bytes], ...]] | None = None
        """(seq, the snapshot's messages as of it)."""
        self._thread.start()

    @property
    def num_blocked(self) -> int:
        """Sessions whose client's queue is full, as of the last round (any thread)."""
        return len(self._blocked)

    def _loop(self) -> None:
        sock = self._sock
        try:
            while not self._stop.is_set():
                self._apply_state()
                busy = self._serve_round()
                if self._wait_for_requests(busy):
                    for _ in range(256):  # take what is there, then serve again
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._request(frames)
                self._admit_waiting()
        finally:
            sock.close(linger=0)

    def _wait_for_requests(self, busy: bool) -> bool:
        """Whether requests are waiting. Busy, it only looks; idle (or every client parked),
        it waits until the first parked session is due, at most REPLAY_IDLE_WAIT_MS. A wait
        under a millisecond (a reader whose queue was full a moment ago: it drains it in less)
        is a sleep, as polls count whole milliseconds."""
        wait_ms = 0.0 if busy else float(REPLAY_IDLE_WAIT_MS)
        if self._parked and not busy:
            wait_ms = min(wait_ms, max(0.0, (self._parked[0][0] - time.monotonic()) * 1000))
        if wait_ms < 1:
            time.sleep(wait_ms / 1000)
            wait_ms = 0
        return bool(self._sock.poll(math.ceil(wait_ms)))

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
            chunks = [] if state.seq < 0 else snapshot_chunks(state.events())
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
            self._sessions[identity] = session  # parked or ready, as the old one was
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
        self._start(self._session(frames, now))

    def _wait(self, identity: bytes, frames: list[bytes]) -> None:
        if len(self._waiting) >= MAX_WAITING_REQUESTS:
            del self._waiting[next(iter(self._waiting))]
            self._dropped("more than %d replay requests waiting: the oldest", MAX_WAITING_REQUESTS)
        self._waiting[identity] = frames

    def _admit_waiting(self) -> None:
        now = time.monotonic()
        while self._waiting and len(self._sessions) < MAX_REPLAY_SESSIONS:
            identity = next(iter(self._waiting))
            self._start(self._session(self._waiting.pop(identity), now))

    def _start(self, session: _Session) -> None:
        self._sessions[session.identity] = session
        self._ready[session.identity] = None

    def _end(self, identity: bytes) -> None:
        del self._sessions[identity]
        self._ready.pop(identity, None)
        self._blocked.pop(identity, None)

    def _dropped(self, why: str, arg: float) -> None:
        """Count a dropped session; log the first and then one in every 1,000."""
        self.num_sessions_dropped += 1
        n = self.num_sessions_dropped
        if n == 1 or n % 1000 == 0:
            logger.warning("KV event replay: " + why + "; dropped it (%d so far)", arg, n)

    def _serve_round(self) -> bool:
        """A turn of every ready session, the parked ones now due included (they try one
        message); whether any send went through."""
        now = time.monotonic()
        num_tries = self._unpark(now)
        ready = self._ready
        num_serving = max(1, len(ready) - num_tries)
        limit = max(1, min(REPLAY_SLICE, REPLAY_ROUND_BUDGET // num_serving))
        progressed = False
        for identity in list(ready):
            session = self._sessions[identity]
            try:
                turn = self._serve_slice(session, 1 if session.num_blocked else limit)
            except zmq.ZMQError as e:  # EHOSTUNREACH: the client went away
                self._end(identity)
                if e.errno != zmq.EHOSTUNREACH:
                    logger.warning("KV event replay: send failed: %s", e)
                continue
            if turn.num_sent or turn.done:
                progressed = True
                session.last_progress = now
            if turn.done:
                self._end(identity)
            elif now - session.last_progress > REPLAY_STALL_S:
                self._end(identity)
                self._dropped("a replay client read nothing for %.0fs", REPLAY_STALL_S)
            else:
                self._after_turn(session, turn, now)
        return progressed

    def _unpark(self, now: float) -> int:
        """Parked sessions whose retry time has come join the end of the round, at most
        REPLAY_TRIES_PER_ROUND of them (the rest come up next round, so a crowd parked at once
        never makes one long round); how many joined."""
        parked, sessions, ready = self._parked, self._sessions, self._ready
        num_tries = 0
        while parked and parked[0][0] <= now and num_tries < REPLAY_TRIES_PER_ROUND:
            identity = heapq.heappop(parked)[1]
            session = sessions.get(identity)
            if session is not None and identity not in ready and session.retry_at <= now:
                ready[identity] = None
                num_tries += 1
        return num_tries

    def _after_turn(self, session: _Session, turn: _Slice, now: float) -> None:
        """Keep the blocked table up to date; park a session whose client's queue is full."""
        identity = session.identity
        if turn.num_sent:
            self._blocked.pop(identity, None)  # it read: blocked again, it goes to the back
            session.num_blocked = 0
        if turn.blocked:
            self._park(session, now)

    def _park(self, session: _Session, now: float) -> None:
        """Out of the rounds until its retry time (REPLAY_BACKOFF_S, jittered): nothing more
        is sent or copied for it meanwhile. Retry times fall on a grid of a quarter of the
        delay, so a crowd's tries come in a few batches a second, not one wake-up each (2,000
        wake-ups a second cost more than the tries themselves)."""
        self._blocked.setdefault(session.identity, now)
        first, most = REPLAY_BACKOFF_S
        delay = min(most, first * (1 << min(session.num_blocked, 16)))
        grain = delay / 4
        session.retry_at = math.ceil((now + delay * (0.5 + random.random())) / grain) * grain
        session.num_blocked += 1
        del self._ready[session.identity]
        heapq.heappush(self._parked, (session.retry_at, session.identity))

    def _serve_slice(self, session: _Session, limit: int) -> _Slice:
        """Send up to `limit` messages of `session`'s answer, non-blocking (a parked session's
        try has `limit` 1: one ring entry sliced, one send)."""
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
