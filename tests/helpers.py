"""Shared builders for the tests: free ports, batches, raw ZMQ peers."""

from __future__ import annotations

import os
import random
import selectors
import socket
import time
from collections.abc import Callable
from typing import Any

import zmq

from kvconnect.events import BlockRemoved, BlockStored, KVEventBatch
from kvconnect.stream.publisher import EventPublisher, ZmqEventPublisher
from kvconnect.stream.subscriber import KVEventSubscriber, ReceivedBatch, SubscriberItem

# Ports the tests choose (rather than the kernel: a process told its port binds it only later):
# all below the kernel's ephemeral range (32768-60999), where an outgoing connection of any
# process could take one between the choice and the bind.
SERVE_BASES = range(2000, 12000)
"""`kvconnect serve` HTTP ports; the KV event ports it derives (+10000, +20000) stay below
32000."""
PLAIN_PORTS = range(12000, 32000)
"""Everything else (publishers, routers, redis-server, raw sockets)."""

_rng = random.Random()  # its own generator: a test seeding `random` must not repeat ports
_handed_out: set[int] = set()
"""Ports this process has given a test already: never again in this session (libzmq and
killed processes release theirs late, and a serve port's derived ones are taken too)."""


def _worker() -> tuple[int, int]:
    """(this pytest-xdist worker's index, the number of workers); (0, 1) without xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(name.removeprefix("gw")), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def worker_ports(ports: range, span: int = 1) -> list[int]:
    """The ports p of `ports` that this worker may use with p..p+span-1. Parallel workers own
    disjoint ports: p belongs to worker (p % 10000) * count // 10000. Ports 10000 apart have
    one owner, so a `kvconnect serve` port and the event ports it derives (+10000, +20000)
    all belong to the worker that chose it."""
    index, count = _worker()
    owned = range(index * 10000 // count, (index + 1) * 10000 // count)
    return [p for p in ports if p % 10000 in owned and p % 10000 + span - 1 in owned]


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def pick_port(candidates: list[int], ports_of: Callable[[int], list[int]]) -> int:
    """A random candidate p whose `ports_of(p)` are all free now and new to this process."""
    for _ in range(500):
        port = _rng.choice(candidates)
        ports = ports_of(port)
        if not _handed_out.intersection(ports) and all(_bindable(p) for p in ports):
            _handed_out.update(ports)
            return port
    raise RuntimeError("no free port found")


def free_port(span: int = 1) -> int:
    """A port p such that p..p+span-1 are free on 127.0.0.1 right now, from this xdist
    worker's share of `PLAIN_PORTS`."""
    return pick_port(worker_ports(PLAIN_PORTS, span), lambda p: list(range(p, p + span)))


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


def bound_xpub(endpoint: str, ctx: zmq.Context[Any] | None = None) -> zmq.Socket[bytes]:
    """A raw publisher socket for hand-made frames: an XPUB, so a test can wait for its
    subscriber (`wait_subscribed`) instead of sleeping."""
    sock = (ctx or zmq.Context.instance()).socket(zmq.XPUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    return sock


def wait_subscribed(xpub: zmq.Socket[bytes], timeout: float = 10.0) -> None:
    """Return once a subscription reached `xpub` (messages sent after this are delivered)."""
    assert xpub.poll(int(timeout * 1000)), "no subscriber came"
    assert xpub.recv()[:1] == b"\x01"


def wait_for(
    condition: Callable[[], bool],
    timeout: float = 10.0,
    interval: float = 0.01,
    what: str | Callable[[], object] = "condition not met in time",
) -> float:
    """Seconds until `condition()` held, checked every `interval` seconds; fails after
    `timeout` seconds with `what` (if callable, called then: the state it saw). The tests'
    one polling loop, for a state no event announces (a router's index, a metric over HTTP);
    where something can be waited on (a socket, a pipe, a process's exit) wait on that."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, what() if callable(what) else what
        time.sleep(interval)
    return time.monotonic() - start


class RedisMonitor:
    """The commands redis-servers receive, read from a MONITOR connection to each: a test
    acts at the nth GET by blocking on these sockets (Redis prints each command as it runs
    it), not by polling INFO. Open it before the traffic it counts."""

    def __init__(self, ports: list[int]) -> None:
        self._selector = selectors.DefaultSelector()
        self._pending: dict[socket.socket, bytes] = {}
        for port in ports:
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(b"MONITOR\r\n")
            reply = b""
            while b"\r\n" not in reply:  # "+OK": from now on every command is shown
                reply += sock.recv(64)
            ok, _, self._pending[sock] = reply.partition(b"\r\n")
            assert ok == b"+OK", reply
            self._selector.register(sock, selectors.EVENT_READ)

    def wait(self, command: str, num: int, timeout: float = 30.0) -> bool:
        """Until `num` `command`s (a name such as "get") reached the servers in all, counted
        from the start; False if they did not within `timeout` seconds."""
        seen, name = 0, b'"' + command.lower().encode() + b'"'
        deadline = time.monotonic() + timeout
        while seen < num:
            ready = self._selector.select(max(0.0, deadline - time.monotonic()))
            if not ready:
                return False
            for key, _ in ready:
                seen += self._count(key.fileobj, name)  # type: ignore[arg-type]
        return True

    def _count(self, sock: socket.socket, name: bytes) -> int:
        """How many of the lines `sock` has for us show command `name` (a line: +<time>
        [<db> <client>] "get" "<key>", arguments escaped); a server gone shows none."""
        try:
            data = sock.recv(1 << 16)
        except ConnectionError:
            data = b""
        if not data:
            self._selector.unregister(sock)
            return 0
        *lines, self._pending[sock] = (self._pending[sock] + data).split(b"\r\n")
        return sum(line.partition(b"] ")[2].split(b" ", 1)[0].lower() == name for line in lines)

    def close(self) -> None:
        for sock in self._pending:
            sock.close()
        self._selector.close()


def poll_until(
    sub: KVEventSubscriber, condition: Callable[[], bool], timeout: float = 10.0
) -> list[SubscriberItem]:
    """Read `sub` until `condition()` holds; returns what came meanwhile. A SUB socket acts on
    a reconnect (resubscribes) only while its owner uses it, so waiting for a reconnected
    subscriber means reading it."""
    items: list[SubscriberItem] = []
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        if (item := sub.recv(timeout=0.02)) is not None:
            items.append(item)
    return items


def take(sub: KVEventSubscriber, num_batches: int, timeout: float = 10.0) -> list[SubscriberItem]:
    """Items until `num_batches` batches have come (markers included), then a short check that
    nothing else follows; fails the test if they do not come in time."""
    items: list[SubscriberItem] = []
    deadline = time.monotonic() + timeout
    while sum(isinstance(i, ReceivedBatch) for i in items) < num_batches:
        item = sub.recv(timeout=max(0.0, deadline - time.monotonic()))
        assert item is not None, f"only {len(items)} items within {timeout}s: {items[-3:]}"
        items.append(item)
    while (extra := sub.recv(timeout=0.2)) is not None:  # nothing more may follow
        items.append(extra)
    return items


def read_through(
    sub: KVEventSubscriber, publisher: EventPublisher, timeout: float = 10.0
) -> list[ReceivedBatch]:
    """Every batch `sub` gets up to the last one `publisher` has published so far."""
    assert isinstance(publisher, ZmqEventPublisher)
    last = publisher.num_published - 1
    batches: list[ReceivedBatch] = []
    deadline = time.monotonic() + timeout
    while last >= 0 and (not batches or batches[-1].seq < last):
        item = sub.recv(timeout=max(0.0, deadline - time.monotonic()))
        assert item is not None, f"seq {last} did not come; last seen {batches[-1:]}"
        assert isinstance(item, ReceivedBatch), item
        batches.append(item)
    return batches


def listening_sockets(pids: list[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket that processes `pids` listen on, read from /proc
    (IPv4 and IPv6); an address other than 127.0.0.1 or ::1 is reachable from elsewhere."""
    inodes: set[str] = set()
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        for fd in os.listdir(fd_dir):
            try:
                link = os.readlink(f"{fd_dir}/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                hex_ip, hex_port = cols[1].split(":")
                raw = bytes.fromhex(hex_ip)
                # /proc prints each 32-bit word in host (little-endian) order.
                ip = b"".join(raw[i : i + 4][::-1] for i in range(0, width // 2, 4))
                family = socket.AF_INET if width == 8 else socket.AF_INET6
                found.append((socket.inet_ntop(family, ip), int(hex_port, 16)))
    return found


def rebind(ep: str, rp: str) -> ZmqEventPublisher:
    """A new publisher on the addresses of one just shut down in this process: libzmq releases
    a closed socket's port asynchronously, so retry briefly (a restarted process has no race)."""
    opened: list[ZmqEventPublisher] = []

    def bound() -> bool:
        try:
            opened.append(ZmqEventPublisher.open(bind=True, endpoint=ep, replay_endpoint=rp))
        except RuntimeError:
            return False
        return True

    wait_for(bound, timeout=5, interval=0.05, what=f"{ep} or {rp} still taken after 5 s")
    return opened[0]
