"""The event stream under a subscriber that is SIGKILLed and restarted again and again with a
tiny receive HWM: every batch arrives once and in order while the ring holds it, and exactly
what the ring dropped is reported lost. Publisher restarts at every seq relation are in
tests/stream/test_subscriber.py (a restart behind a disconnect, whatever the new seqs)."""

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

from kvconnect.stream.publisher import ZmqEventPublisher
from tests.helpers import make_batch, tcp_pair

TOTAL = 100_000
RING = 10_000

SUBSCRIBER = """
import sys
from kvconnect.stream.subscriber import (
    EventsLost, KVEventSubscriber, PublisherRestarted, ReceivedBatch,
)
ep, rp, start = sys.argv[1], sys.argv[2], int(sys.argv[3])
out = sys.stdout
with KVEventSubscriber(ep, rp, start_seq=start, hwm=10) as sub:
    print("up", flush=True)
    for item in sub:
        if isinstance(item, ReceivedBatch):
            ok = item.batch.events[0].block_hashes[0] == item.seq * 1000
            out.write(f"{item.seq}\\n" if ok else f"bad {item.seq}\\n")
        elif isinstance(item, EventsLost):
            out.write(f"lost {item.first_seq} {item.last_seq}\\n")
        elif isinstance(item, PublisherRestarted):
            out.write("restarted\\n")
        out.flush()
"""


class Tail:
    """A subscriber process and the lines it has printed."""

    def __init__(self, ep: str, rp: str, start: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SUBSCRIBER, ep, rp, str(start)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "up"

    def lines(self) -> Iterator[str]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            yield line.strip()

    def kill(self) -> list[str]:
        """SIGKILL it; the lines it had printed but we had not read yet."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        assert self.proc.stdout is not None
        rest = [line.strip() for line in self.proc.stdout]
        self.proc.stdout.close()
        return rest


class Window:
    """How far the feeder may run ahead of what the test has read (the ring must still hold
    what a restarted subscriber asks for): the feeder waits on a condition the reader
    notifies."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.last_read = -1
        self.closed = False
        self._cond = threading.Condition()

    def read(self, seq: int) -> None:
        with self._cond:
            self.last_read = seq
            self._cond.notify()

    def wait_room(self, seq: int) -> None:
        """Until `seq` may be published (or the window is closed)."""
        with self._cond:
            self._cond.wait_for(lambda: seq - self.last_read <= self.size or self.closed)

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify()


def test_100k_batches_through_a_subscriber_killed_four_times_arrive_once_in_order() -> None:
    ep, rp = tcp_pair()
    pub = ZmqEventPublisher.open(bind=True, endpoint=ep, replay_endpoint=rp, buffer_steps=RING)
    window = Window(RING // 2)  # the ring holds the rest

    def feed() -> None:
        for i in range(TOTAL):
            window.wait_room(i)
            pub.publish(make_batch(i))

    got: list[int] = []
    other: list[str] = []
    tail = Tail(ep, rp, 0)
    feeder = threading.Thread(target=feed, daemon=True)
    try:
        assert pub.wait_for_subscriber(timeout=30)
        feeder.start()
        for kill_at in (15_000, 40_000, 65_000, 85_000, None):
            for line in tail.lines():
                if line.isdigit():
                    got.append(int(line))
                    window.read(got[-1])
                else:
                    other.append(line)
                if kill_at is not None and got and got[-1] >= kill_at:
                    break
                if kill_at is None and got and got[-1] == TOTAL - 1:
                    break
            if kill_at is None:
                break
            got += [int(x) for x in tail.kill() if x.isdigit()]  # printed before it died
            window.read(got[-1])
            tail = Tail(ep, rp, got[-1] + 1)  # a restarted process resumes where it was
        assert other == []  # nothing lost, nothing garbled, no false restart
        assert len(got) == TOTAL and got == list(range(TOTAL))  # once each, in order
    finally:
        window.close()
        tail.kill()
        pub.shutdown()


def test_a_subscriber_down_longer_than_the_ring_learns_exactly_what_was_dropped() -> None:
    ep, rp = tcp_pair()
    ring = 500
    pub = ZmqEventPublisher.open(bind=True, endpoint=ep, replay_endpoint=rp, buffer_steps=ring)
    tail = Tail(ep, rp, 0)
    try:
        assert pub.wait_for_subscriber(timeout=30)
        for i in range(1000):
            pub.publish(make_batch(i))
        got = []
        for line in tail.lines():
            got.append(line)
            if line == "999":
                break
        assert got == [str(i) for i in range(1000)]
        tail.kill()
        for i in range(1000, 3200):  # while it is down: the ring keeps only 2700..3199
            pub.publish(make_batch(i))
        tail = Tail(ep, rp, 1000)
        got = []
        for line in tail.lines():
            got.append(line)
            if line == "3199":
                break
        assert got == ["lost 1000 2699"] + [str(i) for i in range(2700, 3200)]
    finally:
        tail.kill()
        pub.shutdown()
