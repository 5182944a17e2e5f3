"""Replay abuse (issue 25, point 12; issue 35, item 5): 1,000 clients that each ask for the
whole ring twice and never read must not starve a real subscriber, make it report losses the
ring does not have (a router that hears "lost" clears that instance's index), or grow the
publisher's memory beyond what `stream/replay.py` states per blocked client; whether their
requests all came before the subscriber's or arrive while its answer is under way, again and
again."""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvconnect.stream.publisher import ZmqEventPublisher
from kvconnect.stream.replay import MAX_QUEUED_BYTES_PER_BLOCKED_CLIENT
from kvconnect.stream.subscriber import KVEventSubscriber
from tests.helpers import make_batch, tcp_pair

RING = 10_000
FLOODERS = 1000
EVENTS_PER_BATCH = 32
"""~2.9 KB batches: under the replay's copy threshold, so what waits for a client that reads
nothing is copies (bigger batches wait as the ring's own bytes: the last test below)."""
ZMQ_CONNECTION_BYTES = 96 << 10
"""What libzmq itself keeps per connection that has carried traffic (pipe chunks, stream
buffers; 50-80 KB measured, whether its client reads or not): on top of the replay's bound."""

# At "go" each client asks for the whole ring N times (the line says N: the flood is
# 2, back to back); with "again" every client asks anew every 0.1 s (each request replacing its
# last) until stdin closes. None reads an answer. Their receive buffers are 4 KiB (a client's
# own choice): the publisher meets the same 1,000 stalled sessions after less traffic (with the
# kernel's default buffers each absorbed ~700 batches first, and the test took three times as
# long to exercise nothing more).
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
word = sys.stdin.readline().strip()
again = word == "again"
rounds = 0
while True:
    for s in socks:
        try:
            s.send_multipart([b"", (0).to_bytes(8, "big")], zmq.NOBLOCK)
        except zmq.Again:
            pass
    rounds += 1
    if again and select.select([sys.stdin], [], [], 0.1)[0]:
        break
    if not again and rounds == int(word):
        break
sys.stdin.read()
"""

# The legitimate subscriber, in its own process so that the test's memory is the publisher's:
# it needs the whole ring from seq 0 and prints one JSON line of what it got.
READER = """
import json, sys, time
from kvconnect.stream.subscriber import EventsLost, KVEventSubscriber, ReceivedBatch
ep, rp, ring = sys.argv[1], sys.argv[2], int(sys.argv[3])
start = time.monotonic()
seqs, lost = [], []
with KVEventSubscriber(ep, rp, start_seq=0) as sub:
    while len(seqs) + sub.num_batches_lost < ring:
        item = sub.recv(timeout=120)
        if item is None:
            break
        if isinstance(item, EventsLost):
            lost.append([item.first_seq, item.last_seq])
        elif isinstance(item, ReceivedBatch):
            seqs.append(item.seq)
    print(json.dumps({
        "received": len(seqs),
        "in_order": seqs == list(range(ring)),
        "lost": lost,
        "replay_failures": sub.num_replay_failures,
        "duplicates": sub.num_duplicates,
        "ms": round((time.monotonic() - start) * 1000),
    }))
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
    for i in range(RING):
        pub.publish(make_batch(i, num_events=EVENTS_PER_BATCH))
    assert pub.flush()
    before = rss_bytes()
    proc = subprocess.Popen(
        [sys.executable, "-c", FLOOD, rp, str(FLOODERS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    reader = None
    try:
        assert proc.stdin is not None and proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"

        def go(word: str) -> None:
            assert proc.stdin is not None
            proc.stdin.write(word + "\n")
            proc.stdin.flush()

        if flood == "before":  # the flood: every client asked twice from seq 0
            go("2")
            wait_until(lambda: pub.num_replay_requests >= 2 * FLOODERS, "flood requests")
            starter = None
        else:  # the flood starts once the subscriber's request is in, and asks again and again
            first = pub.num_replay_requests + 1

            def start_flood() -> None:
                wait_until(lambda: pub.num_replay_requests >= first, "subscriber request")
                go("again")

            starter = threading.Thread(target=start_flood)
            starter.start()
        reader = subprocess.Popen(
            [sys.executable, "-c", READER, ep, rp, str(RING)], stdout=subprocess.PIPE, text=True
        )
        out, _ = reader.communicate(timeout=240)
        growth = rss_bytes() - before
        if starter is not None:
            starter.join()
        got = json.loads(out)
        # Every batch once, in order; nothing reported lost; its answer never stalled into a
        # retry (num_replay_failures).
        assert got["lost"] == [] and got["received"] == RING and got["in_order"], got
        assert got["replay_failures"] == 0 and got["duplicates"] == 0, got
        assert pub.num_replay_requests > FLOODERS
        bound = FLOODERS * (MAX_QUEUED_BYTES_PER_BLOCKED_CLIENT + ZMQ_CONNECTION_BYTES)
        assert growth < bound, f"publisher grew {growth >> 20} MiB (bound {bound >> 20} MiB)"
        print(
            f"\nreplay of {RING} batches, {FLOODERS} clients that do not read ({flood}): "
            f"{got['ms']} ms, {pub.num_replay_requests} requests, "
            f"{pub.num_replay_sessions_dropped} sessions dropped, "
            f"publisher memory +{growth >> 20} MiB (bound {bound >> 20} MiB)"
        )
    finally:
        if reader is not None:
            reader.kill()
            reader.wait()
        proc.kill()
        proc.wait()
        pub.shutdown()


def test_big_batches_wait_for_clients_that_do_not_read_as_the_rings_own_bytes() -> None:
    """What is queued for a client that reads nothing is the ring's bytes, not copies: 50 such
    clients, 16 messages queued each (REPLAY_CLIENT_HWM), 200 KB batches (160 MB if copied)."""
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
        proc.stdin.write(b"1\n")
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
