"""The publisher's replay server: answers replay and snapshot requests on its own thread.

Owned by `ZmqEventPublisher`, which appends every published batch to the shared `ReplayRing`
and hands it to `observe()`; this thread keeps the stream's state (`state.StreamState`) from
those batches and serves a ROUTER socket (wire: `wire.py`).

Service is bounded and fair. Every request becomes a session answered a slice at a time,
round-robin across sessions, with non-blocking sends on a small per-client queue: a client that
does not read fills its own queue and is skipped, so it costs one failed send per round and
never delays another client. A session that makes no progress for `REPLAY_STALL_S` is dropped,
and at `MAX_REPLAY_SESSIONS` the least recently progressing one makes room, so the work spent
on clients that do not read is bounded by the session count times their socket buffers; within
a round the least served session goes first. What waits for a client is bounded by its queue
(64 messages), so memory stays within the ring plus a small per-client overhead.

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
from queue import Empty, SimpleQueue
from typing import Any

import zmq

from kvconnect.events import BlockStored, KVEventBatch, encode_batch
from kvconnect.stream.state import StreamState
from kvconnect.stream.wire import END_SEQ, MAX_REQUEST_BYTES, SNAPSHOT_REQUEST, PublisherStatus

logger = logging.getLogger(__name__)

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
    num_sent: int = 0
    """Messages sent so far: the least served session goes first in each round."""


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
        self._thread = threading.Thread(target=self._loop, name="kv-events-replay", daemon=True)
        self._thread.start()

    def observe(self, seq: int, batch: KVEventBatch) -> None:
        """A batch was published as `seq` (any thread; the state is updated on this one)."""
        self._published.put((seq, batch))

    def stop(self, timeout: float = 1.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _loop(self) -> None:
        sock = self._sock
        sessions: dict[bytes, _Session] = {}
        try:
            while not self._stop.is_set():
                self._apply_state()
                busy = self._serve_round(sessions)
                # Idle, or every client's queue full: wait for requests a moment, else go on.
                if sock.poll(0 if busy else 5 if sessions else 50):
                    for _ in range(256):  # take what is there, then serve again
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._accept(sessions, frames)
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
        fence = max(0, state.seq).to_bytes(8, "big")
        # Nothing published yet: no snapshot (replay from 0 is the whole stream). Else at
        # least one batch, which names the stream (topic, rank) even when it holds nothing.
        chunks = [] if state.seq < 0 else _snapshot_chunks(state.events())
        rank = self._data_parallel_rank
        parts = deque((fence, encode_batch(KVEventBatch(time.time(), c, rank))) for c in chunks)
        answered = self._status()
        answered = PublisherStatus(answered.epoch, state.seq + 1)
        return _Session(identity, 0, 0, answered.encode(), parts, now)

    def _accept(self, sessions: dict[bytes, _Session], frames: list[bytes]) -> None:
        identity = frames[0]
        self.num_requests += 1
        now = time.monotonic()
        if len(frames) == 3 and frames[1] == b"" and frames[2] == SNAPSHOT_REQUEST:
            session = self._snapshot(identity, now)
        elif len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            logger.warning(
                "KV event replay: malformed request (%d frames); sent terminator", len(frames)
            )
            session = _Session(identity, 0, 0, self._status().encode(), None, now)
        else:
            start_seq = int.from_bytes(frames[2], "big")
            status = self._status()
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
        self.num_sessions_dropped += 1
        n = self.num_sessions_dropped
        if n == 1 or n % 1000 == 0:
            logger.warning("KV event replay: " + why + "; dropped it (%d so far)", arg, n)

    def _serve_round(self, sessions: dict[bytes, _Session]) -> bool:
        """One slice of every session's answer; whether any send went through."""
        progressed = False
        now = time.monotonic()
        for session in sorted(sessions.values(), key=lambda s: s.num_sent):
            try:
                sent = self._serve_slice(session)
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

    def _serve_slice(self, session: _Session) -> int | None:
        """Send up to REPLAY_SLICE messages of `session`'s answer: how many went (None: the
        terminator went too, the answer is complete). zmq.Again stops at a full queue."""
        sock, ident, topic, sent = self._sock, session.identity, self._topic, 0
        flags = zmq.NOBLOCK
        try:
            if session.parts is not None:
                parts = session.parts
                while parts and sent < REPLAY_SLICE:
                    seq_bytes, payload = parts[0]
                    sock.send_multipart((ident, b"", topic, seq_bytes, payload), flags)
                    parts.popleft()
                    sent += 1
                if parts:
                    return sent
            else:
                first, entries = self._ring.slice(session.next_seq, session.end_seq, REPLAY_SLICE)
                # Batches the ring dropped meanwhile are skipped: the client sees the gap.
                session.next_seq = max(session.next_seq, first)
                for seq, seq_bytes, payload in entries:
                    sock.send_multipart((ident, b"", topic, seq_bytes, payload), flags)
                    session.next_seq = seq + 1
                    sent += 1
                if session.next_seq < session.end_seq and entries:
                    return sent
            # The next seq as of the request: every batch before it was in this answer or live.
            sock.send_multipart((ident, b"", session.status, END_SEQ, b""), flags)
            return None
        except zmq.Again:
            return sent
