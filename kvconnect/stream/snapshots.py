"""vLLM PR #57789's snapshot service (open PR): the stream's state on an endpoint of its own.

Owned by `ZmqEventPublisher` when `KVEventsConfig.snapshot_endpoint` is set. The publisher hands
every batch to `observe(seq, batch)` before it sends it live (so any batch a subscriber has seen
is in the next snapshot it asks for); this thread folds them into a `state.StreamState` and
answers each request on its ROUTER socket with one message (wire: `wire.py`):

    request   any single frame (REQ), or [b"", frame] (DEALER)
    answer    [seq (8 bytes, signed), publisher id (16 bytes), payload, payload, ...]

`seq` is the last batch the state covers: -1 before any (`SNAPSHOT_NONE`), -2 when the answer
would exceed `MAX_SNAPSHOT_BYTES` (`SNAPSHOT_UNAVAILABLE`: the consumer falls back to replay).
Each payload is an ordinary `KVEventBatch` of BlockStored events (the compacted state: what the
events leave, each block with the fields of the event that stored it, counted per medium,
locality and ownership), cut as the replay server's snapshots are. A consumer applies them to a
private index, then the live batches after `seq` from the same publisher id (the subscriber's
bootstrap: `subscriber.py`).

The requests read before a round are answered from one encoding (a crowd shares it); a
requester that does not read is not waited for (non-blocking sends: it asks again). This is
the PR's contract on kvconnect's state: the PR's recorder keeps whole source events and
removals; kvconnect's state is already compacted to stores, which a fresh index takes alike.
"""

from __future__ import annotations

import logging
import time
from contextlib import suppress
from queue import Empty

import zmq

from kvconnect.events import KVEventBatch, encode_batch
from kvconnect.stream.replay import snapshot_chunks
from kvconnect.stream.state import StateServer
from kvconnect.stream.wire import MAX_REQUEST_BYTES, SNAPSHOT_NONE, SNAPSHOT_UNAVAILABLE

logger = logging.getLogger(__name__)

MAX_SNAPSHOT_BYTES = 256 << 20
"""An answer larger than this is not sent: the answer is `SNAPSHOT_UNAVAILABLE` (the PR's
reply bound)."""
MAX_REQUESTS_PER_ROUND = 32
"""Requests answered from one encoding of the state (the PR's)."""
POLL_MS = 20


class SnapshotServer(StateServer):
    """Serves the stream's state on `sock` (bound by the caller) until `stop()`."""

    def __init__(
        self, sock: zmq.Socket[bytes], publisher_id: bytes, data_parallel_rank: int
    ) -> None:
        super().__init__(sock, "kv-events-snapshot")
        self._publisher_id = publisher_id
        self._data_parallel_rank = data_parallel_rank
        self.num_requests = 0
        self.num_unavailable = 0
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if self._sock.poll(POLL_MS):
                    self._serve()
                else:
                    self._apply()
        except zmq.ZMQError as e:
            logger.warning("KV event snapshots: stopped: %s", e)
        finally:
            self._sock.close(linger=0)

    def _apply(self) -> None:
        # What was published when the request came: later batches cannot postpone it.
        for _ in range(self._published.qsize()):
            try:
                seq, batch = self._published.get_nowait()
            except Empty:
                return
            self.state.apply(seq, batch)

    def _serve(self) -> None:
        envelopes: list[list[bytes]] = []
        while len(envelopes) < MAX_REQUESTS_PER_ROUND and self._sock.poll(0):
            frames = self._sock.recv_multipart()
            self.num_requests += 1
            # The routing envelope: the identity, and the empty delimiter a REQ or DEALER sent.
            cut = frames.index(b"") + 1 if b"" in frames[1:] else 1
            envelopes.append(frames[:cut])
        self._apply()
        answer = self._answer()
        for envelope in envelopes:
            with suppress(zmq.Again):  # a requester that does not read asks again
                self._sock.send_multipart(envelope + answer, flags=zmq.NOBLOCK, copy=False)

    def _answer(self) -> list[bytes]:
        state, rank = self.state, self._data_parallel_rank
        seq = state.seq if state.seq >= 0 else SNAPSHOT_NONE
        now = time.time()
        payloads = [
            encode_batch(KVEventBatch(now, c, rank)) for c in snapshot_chunks(state.events())
        ]
        if sum(map(len, payloads)) > MAX_SNAPSHOT_BYTES:
            self.num_unavailable += 1
            seq, payloads = SNAPSHOT_UNAVAILABLE, []
        return [seq.to_bytes(8, "big", signed=True), self._publisher_id, *payloads]


def open_snapshot_socket(ctx: zmq.Context[zmq.Socket[bytes]]) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
    sock.setsockopt(zmq.SNDHWM, MAX_REQUESTS_PER_ROUND)
    sock.setsockopt(zmq.LINGER, 0)
    return sock
