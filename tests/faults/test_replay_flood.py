"""Replay abuse (issue 25, point 12): 1,000 clients that ask for the whole ring and never read
must not starve a real subscriber, make it report losses the ring does not have, or grow the
publisher's memory without bound; whether their requests all came before the subscriber's or
arrive while its answer is under way, again and again."""

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvconnect.stream.publisher import ZmqEventPublisher
from kvconnect.stream.subscriber import EventsLost, KVEventSubscriber, ReceivedBatch
from tests.helpers import make_batch, tcp_pair

RING = 10_000
FLOODERS = 1000

# Each client asks for the whole ring once at "go"; with "again" every client asks anew every
# 0.1 s (each request replacing its last) until stdin closes. None reads an answer. Their
# receive buffers are 4 KiB (a client's own choice): the publisher meets the same 1,000 stalled
# sessions after less traffic (with the kernel's default buffers each absorbed ~700 batches
# first, and the test took three times as long to exercise nothing more).
FLOOD = """
import select, sys, zmq
ctx = zmq.Context()
socks = []
for _ in range(int(sys.argv[2])):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.RCVHWM, 1)
    s.setsockopt(zmq.RCVBUF, 4096)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(sys.argv[1])
    socks.append(s)
print("ready", flush=True)
again = sys.stdin.readline().strip() == "again"
while True:
    for s in socks:
        try:
            s.send_multipart([b"", (0).to_bytes(8, "big")], zmq.NOBLOCK)
        except zmq.Again:
            pass
    if not again or select.select([sys.stdin], [], [], 0.1)[0]:
        break
sys.stdin.read()
"""


def rss_bytes() -> int:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096


def wait_until(condition: object, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


# The flood's work is real (each client that reads nothing absorbs what its socket buffers
# hold first): seconds on two idle cores, far more on a crowded machine, so alone under xdist
# (and nothing beside it: it keeps both cores busy, starving other tests' deadlines).
@pytest.mark.slow
@pytest.mark.alone
@pytest.mark.timeout(300)
@pytest.mark.parametrize("flood", ["before", "during"])
def test_a_flood_of_non_reading_clients_neither_starves_nor_fakes_losses(flood: str) -> None:
    ep, rp = tcp_pair()
    pub = ZmqEventPublisher.open(bind=True, endpoint=ep, replay_endpoint=rp, buffer_steps=RING)
    proc = subprocess.Popen(
        [sys.executable, "-c", FLOOD, rp, str(FLOODERS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    sub = None
    try:
        assert proc.stdin is not None and proc.stdout is not None
        for i in range(RING):
            pub.publish(make_batch(i, num_events=4))
        assert pub.flush()
        before = rss_bytes()
        assert proc.stdout.readline().strip() == "ready"

        def go(word: str) -> None:
            assert proc.stdin is not None
            proc.stdin.write(word + "\n")
            proc.stdin.flush()

        if flood == "before":  # every flooder's request is in: the publisher is busy with them
            go("once")
            wait_until(lambda: pub.num_replay_requests >= FLOODERS, "flood requests")
            starter = None
        else:  # the flood starts once the subscriber's request is in, and asks again and again
            first = pub.num_replay_requests + 1

            def start_flood() -> None:
                wait_until(lambda: pub.num_replay_requests >= first, "subscriber request")
                go("again")

            starter = threading.Thread(target=start_flood)
            starter.start()
        start = time.monotonic()
        sub = KVEventSubscriber(ep, rp, start_seq=0)
        got = []
        while len(got) < RING:
            item = sub.recv(timeout=120)
            assert item is not None, f"stalled after {len(got)} batches"
            assert not isinstance(item, EventsLost), item
            assert isinstance(item, ReceivedBatch)
            got.append(item.seq)
        latency = time.monotonic() - start
        growth = rss_bytes() - before
        if starter is not None:
            starter.join()
        assert got == list(range(RING))  # every batch once, in order
        assert sub.num_batches_lost == 0 and sub.num_duplicates == 0
        assert sub.num_replay_failures == 0  # its answer never stalled: it never gave up
        assert pub.num_replay_requests > FLOODERS
        assert growth < 200 << 20, f"publisher grew {growth >> 20} MiB"
        print(
            f"\nreplay of {RING} batches, {FLOODERS} clients that do not read ({flood}): "
            f"{latency * 1000:.0f} ms, {pub.num_replay_requests} requests, "
            f"{pub.num_replay_sessions_dropped} sessions dropped, memory +{growth >> 20} MiB"
        )
    finally:
        if sub is not None:
            sub.close()
        proc.kill()
        proc.wait()
        pub.shutdown()


def test_big_batches_wait_for_clients_that_do_not_read_as_the_rings_own_bytes() -> None:
    """What is queued for a client that reads nothing is the ring's bytes, not copies: 50 such
    clients, 64 messages queued each, 200 KB batches (640 MB if copied)."""
    ep, rp = tcp_pair()
    pub = ZmqEventPublisher.open(bind=True, endpoint=ep, replay_endpoint=rp, buffer_steps=64)
    proc = subprocess.Popen(
        [sys.executable, "-c", FLOOD, rp, "50"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        for i in range(64):
            pub.publish(make_batch(i, num_events=1, block_size=70_000))
        assert pub.flush()
        assert proc.stdout.readline().strip() == b"ready"
        before = rss_bytes()
        proc.stdin.write(b"once\n")
        proc.stdin.flush()
        wait_until(lambda: pub.num_replay_clients_blocked >= 50, "every flooder blocked")
        growth = rss_bytes() - before
        with KVEventSubscriber(ep, rp, start_seq=0) as sub:
            got = [getattr(sub.recv(timeout=60), "seq", None) for _ in range(64)]
        assert got == list(range(64)) and sub.num_batches_lost == 0
        assert growth < 64 << 20, f"publisher grew {growth >> 20} MiB"
    finally:
        proc.kill()
        proc.wait()
        pub.shutdown()
