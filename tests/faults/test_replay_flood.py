"""Replay abuse: a crowd of clients that ask for the whole ring and never read must not starve
a real subscriber, make it report losses the ring does not have, or grow the publisher's
memory without bound."""

import subprocess
import sys
import time
from pathlib import Path

from kvconnect.stream.publisher import ZmqEventPublisher
from kvconnect.stream.subscriber import EventsLost, KVEventSubscriber, ReceivedBatch
from tests.helpers import make_batch, tcp_pair

RING = 10_000
FLOODERS = 1000

FLOOD = """
import sys, time, zmq
ctx = zmq.Context()
socks = []
for _ in range(int(sys.argv[2])):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.RCVHWM, 1)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(sys.argv[1])
    s.send_multipart([b"", (0).to_bytes(8, "big")])
    socks.append(s)
print("sent", flush=True)
sys.stdin.read()  # never read the answers; hold the connections until told
"""


def rss_bytes() -> int:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096


def test_a_flood_of_non_reading_clients_neither_starves_nor_fakes_losses() -> None:
    ep, rp = tcp_pair()
    pub = ZmqEventPublisher.open(bind=True, endpoint=ep, replay_endpoint=rp, buffer_steps=RING)
    flood = None
    sub = None
    try:
        for i in range(RING):
            pub.publish(make_batch(i, num_events=4))
        assert pub.flush()
        before = rss_bytes()
        flood = subprocess.Popen(
            [sys.executable, "-c", FLOOD, rp, str(FLOODERS)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert flood.stdout is not None and flood.stdout.readline().strip() == "sent"
        # Every flooder's request has reached the publisher: it is busy with them.
        deadline = time.monotonic() + 60
        while pub.num_replay_requests < FLOODERS:
            assert time.monotonic() < deadline, pub.num_replay_requests
            time.sleep(0.01)
        start = time.monotonic()
        sub = KVEventSubscriber(ep, rp, start_seq=0)
        got = []
        while len(got) < RING:
            item = sub.recv(timeout=60)
            assert item is not None, f"stalled after {len(got)} batches"
            assert not isinstance(item, EventsLost), item
            assert isinstance(item, ReceivedBatch)
            got.append(item.seq)
        latency = time.monotonic() - start
        growth = rss_bytes() - before
        assert got == list(range(RING))  # every batch once, in order
        assert sub.num_batches_lost == 0 and sub.num_duplicates == 0
        assert growth < 200 << 20, f"publisher grew {growth >> 20} MiB"
        print(
            f"\nreplay of {RING} batches under a flood of {FLOODERS} clients: "
            f"{latency * 1000:.0f} ms, publisher memory +{growth >> 20} MiB"
        )
    finally:
        if sub is not None:
            sub.close()
        if flood is not None:
            flood.kill()
            flood.wait()
        pub.shutdown()
