"""Shared builders for the tests: free ports, batches, raw ZMQ peers."""

from __future__ import annotations

import socket
import time
from typing import Any

import zmq

from kvconnect.events import BlockRemoved, BlockStored, KVEventBatch

SETTLE_S = 0.2  # time for a SUB subscription to reach a PUB on loopback


def free_port(span: int = 1) -> int:
    """A port p such that p..p+span-1 are free on 127.0.0.1 right now."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + span >= 65535:
            continue
        try:
            for p in range(port + 1, port + span):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return int(port)
    raise RuntimeError("no free port range found")


def tcp_pair() -> tuple[str, str]:
    """(live endpoint, replay endpoint) on free loopback ports, 2 apart (room for DP rank 1)."""
    port = free_port(4)
    return f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 2}"


def make_batch(i: int, num_events: int = 1, block_size: int = 16) -> KVEventBatch:
    """A batch whose content identifies `i`: block hashes i*1000 + j."""
    events: list[Any] = []
    for j in range(num_events):
        h = i * 1000 + j
        if j % 2 == 0:
            events.append(
                BlockStored([h], None, list(range(block_size)), block_size, None, "GPU", None)
            )
        else:
            events.append(BlockRemoved([h], "GPU"))
    return KVEventBatch(time.time(), events)


def batch_id(batch: KVEventBatch) -> int:
    first = batch.events[0]
    h = first.block_hashes[0]  # type: ignore[union-attr]
    assert isinstance(h, int)
    return h // 1000


def recv_frames(sock: zmq.Socket[bytes], timeout: float = 2.0) -> list[bytes] | None:
    if not sock.poll(int(timeout * 1000)):
        return None
    return sock.recv_multipart()


def replay_request(
    endpoint: str, frames: list[bytes], timeout: float = 2.0, ctx: zmq.Context[Any] | None = None
) -> list[list[bytes]]:
    """Send `frames` from a DEALER; return every answer (delimiter stripped) up to the
    terminator inclusive. Fails the test if no terminator comes."""
    ctx = ctx or zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart(frames)
        answers = []
        while True:
            got = recv_frames(dealer, timeout)
            assert got is not None, f"no terminator from {endpoint} after {len(answers)} answers"
            if got and got[0] == b"":
                got = got[1:]
            answers.append(got)
            if got[-1] == b"":
                return answers
    finally:
        dealer.close()
