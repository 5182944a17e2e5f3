"""The event stream's sockets against hostile peers: a frame over a socket's MAXMSGSIZE drops
the sender's connection before anything is allocated for it, and with CURVE keys only a
subscriber that holds the right ones hears anything."""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from kvconnect.commands.events import CURVE_CLIENT_KEY_ENV, CURVE_SERVER_KEY_ENV, curve_from_env
from kvconnect.config import KVEventsConfig
from kvconnect.events import encode_batch
from kvconnect.stream.curve import CurveClientKeys
from kvconnect.stream.publisher import ZmqEventPublisher
from kvconnect.stream.subscriber import KVEventSubscriber
from kvconnect.stream.wire import MAX_REQUEST_BYTES
from tests.helpers import make_batch, take, tcp_pair

PUBLISHER = """
import sys
from kvconnect.commands.events import CURVE_CLIENT_KEY_ENV, CURVE_SERVER_KEY_ENV, curve_from_env
from kvconnect.config import KVEventsConfig
from kvconnect.events import encode_batch
from kvconnect.stream.curve import CurveClientKeys
from kvconnect.stream.publisher import ZmqEventPublisher
from tests.helpers import make_batch
pub = ZmqEventPublisher.open(bind=True, endpoint=sys.argv[1], replay_endpoint=sys.argv[2])
for i in range(10):
    pub.publish(make_batch(i))
print("ready", flush=True)
for line in sys.stdin:  # one batch per line, until the test closes stdin
    pub.publish(make_batch(int(line)))
pub.shutdown()
"""
HUGE = 512 << 20


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def send_request(
    ctx: zmq.Context[Any], endpoint: str, frames: list[Any], timeout: float = 10.0
) -> str:
    """Send `frames` to a replay socket: "refused" when the publisher drops the connection,
    "answered" when it read them whole (and answered)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    monitor = dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart(frames, copy=False)
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        ready = dict(poller.poll(int(timeout * 1000)))
        if monitor in ready:
            assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
            return "refused"
        return "answered" if dealer in ready else "nothing"
    finally:
        dealer.disable_monitor()
        monitor.close(linger=0)
        dealer.close(linger=0)


def test_two_512_mib_frames_to_the_replay_socket_are_refused_with_flat_rss() -> None:
    ep, rp = tcp_pair()
    proc = subprocess.Popen(
        [sys.executable, "-c", PUBLISHER, ep, rp],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        before = rss_bytes(proc.pid)
        # One zero-copy buffer, sent twice: the test's own memory stays the kernel's zero page.
        frame = zmq.Frame(bytearray(HUGE))
        assert send_request(ctx, rp, [b"", frame, frame], timeout=120) == "refused"
        growth = rss_bytes(proc.pid) - before
        assert growth < 16 << 20, f"the publisher grew {growth >> 20} MiB"
        # It still serves: a subscriber replays its history and hears a live batch.
        with KVEventSubscriber(ep, rp, start_seq=0, context=ctx) as sub:
            items = take(sub, 10)
            proc.stdin.write("10\n")
            proc.stdin.flush()
            items += take(sub, 1)
        assert [getattr(item, "seq", None) for item in items] == list(range(11))
    finally:
        proc.kill()
        proc.wait()
        ctx.destroy(linger=0)


def test_a_request_over_the_limit_drops_that_connection_only() -> None:
    ep, rp = tcp_pair()
    ctx: zmq.Context[Any] = zmq.Context()
    pub = ZmqEventPublisher.open(bind=True, endpoint=ep, replay_endpoint=rp, context=ctx)
    good = ctx.socket(zmq.DEALER)
    try:
        pub.publish(make_batch(0))
        good.connect(rp)
        assert send_request(ctx, rp, [b"", b"x" * (MAX_REQUEST_BYTES + 1)]) == "refused"
        assert send_request(ctx, rp, [b"", b"x" * MAX_REQUEST_BYTES]) == "answered"  # malformed
        good.send_multipart([b"", (0).to_bytes(8, "big")])
        assert good.poll(10_000)
        assert good.recv_multipart()[2] == (0).to_bytes(8, "big")  # [b"", topic, seq, payload]
    finally:
        good.close(linger=0)
        pub.shutdown()
        ctx.destroy(linger=0)


def wait_subscription(xpub: zmq.Socket[bytes], sub: KVEventSubscriber) -> None:
    """Read `sub` (a SUB acts on a reconnect only while used) until `xpub` sees it subscribe."""
    for _ in range(200):
        assert sub.recv(timeout=0.05) is None
        while xpub.poll(0):
            if xpub.recv()[:1] == b"\x01":
                return
    raise AssertionError("no subscription in 10 s")


def test_a_batch_over_the_subscribers_limit_cuts_that_connection_and_it_comes_back() -> None:
    ep, _ = tcp_pair()
    ctx: zmq.Context[Any] = zmq.Context()
    xpub = ctx.socket(zmq.XPUB)
    xpub.setsockopt(zmq.XPUB_VERBOSE, 1)  # the resubscription too
    xpub.bind(ep)
    try:
        with KVEventSubscriber(ep, max_message_size=1 << 16, context=ctx) as sub:
            wait_subscription(xpub, sub)
            big = encode_batch(make_batch(0, num_events=2, block_size=40_000))
            assert len(big) > 1 << 16
            xpub.send_multipart([b"", (0).to_bytes(8, "big"), big])
            wait_subscription(xpub, sub)  # cut off, it reconnected and subscribed again
            xpub.send_multipart([b"", (1).to_bytes(8, "big"), encode_batch(make_batch(1))])
            item = sub.recv(timeout=10)
            assert item is not None and getattr(item, "seq", None) == 1
            assert sub.num_bad_frames == sub.num_decode_errors == 0  # never read
    finally:
        xpub.close(linger=0)
        ctx.destroy(linger=0)


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, str]:
    """Certificates as the documented one-liner writes them (under `umask 077`: the owner's
    alone): server, client, and an intruder pair that is not the server's."""
    out = {}
    old_umask = os.umask(0o077)
    try:
        for name in ("server", "client", "other"):
            public, secret = zmq.auth.create_certificates(tmp_path, name)
            out[name], out[name + "_secret"] = str(public), str(secret)
    finally:
        os.umask(old_umask)
    return out


def plain_peer_is_refused(ctx: zmq.Context[Any], kind: int, endpoint: str, **opts: bytes) -> None:
    """A socket without the right keys connects, its handshake fails (an event, not a wait),
    and nothing arrives: the publisher's other subscriber meanwhile gets its batch."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in opts.items():
        sock.setsockopt(getattr(zmq, name), value)
    failed = (
        zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_DISCONNECTED
    )
    monitor = sock.get_monitor_socket(failed | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        if kind == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        if kind == zmq.DEALER:
            sock.send_multipart([b"", (0).to_bytes(8, "big")])
        assert monitor.poll(10_000), "no handshake outcome"
        assert recv_monitor_message(monitor)["event"] & failed
        assert not sock.poll(0)
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)


def test_with_curve_only_the_key_holder_hears_the_stream(keys: dict[str, str]) -> None:
    ep, rp = tcp_pair()
    ctx: zmq.Context[Any] = zmq.Context()
    pub = ZmqEventPublisher.open(
        bind=True,
        endpoint=ep,
        replay_endpoint=rp,
        curve_secret_key_file=keys["server_secret"],
        context=ctx,
    )
    try:
        for i in range(3):
            pub.publish(make_batch(i))
        for kind, endpoint in ((zmq.SUB, ep), (zmq.DEALER, rp)):
            plain_peer_is_refused(ctx, kind, endpoint)  # no CURVE at all
            plain_peer_is_refused(  # CURVE, but with another server's public key
                ctx,
                kind,
                endpoint,
                CURVE_SERVERKEY=zmq.auth.load_certificate(keys["other"])[0],
                CURVE_PUBLICKEY=zmq.auth.load_certificate(keys["client"])[0],
                CURVE_SECRETKEY=zmq.auth.load_certificate(keys["client_secret"])[1] or b"",
            )
        curve = CurveClientKeys.from_files(keys["server"], keys["client_secret"])
        with KVEventSubscriber(ep, rp, start_seq=0, curve=curve, context=ctx) as sub:
            items = take(sub, 3)  # replayed through the encrypted ROUTER
            assert pub.wait_for_subscriber()
            pub.publish(make_batch(3))
            items += take(sub, 1)  # live through the encrypted XPUB
        assert [getattr(item, "seq", None) for item in items] == [0, 1, 2, 3]
        assert sub.num_replay_failures == 0
    finally:
        pub.shutdown()
        ctx.destroy(linger=0)


def test_bad_key_files_are_clear_errors(keys: dict[str, str], tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.key_secret"
    garbage.write_text('metadata\ncurve\n    public-key = "short"\n')
    mismatched = tmp_path / "mixed.key_secret"
    server = Path(keys["server_secret"]).read_text()
    other_secret = zmq.auth.load_certificate(keys["other_secret"])[1] or b""
    secret_line = next(line for line in server.splitlines() if "secret-key" in line)
    mismatched.write_text(
        server.replace(secret_line, f'    secret-key = "{other_secret.decode()}"')
    )
    for written in (garbage, mismatched):
        written.chmod(0o600)
    for path, why in (
        (tmp_path / "missing", "no such key file"),
        (garbage, "not 40 Z85 characters"),
        (Path(keys["server"]), "holds no secret key"),
        (mismatched, "does not belong to its public key"),
    ):
        with pytest.raises(ValueError, match=f"curve_secret_key_file=.*{why}"):
            ZmqEventPublisher.open(endpoint="tcp://127.0.0.1:0", curve_secret_key_file=str(path))
    with pytest.raises(ValueError, match="holds no secret key"):
        CurveClientKeys.from_files(keys["server"], keys["client"])
    with pytest.raises(ValueError, match="must be a file path or null"):
        KVEventsConfig(curve_secret_key_file="")


def test_events_tail_reads_a_curve_stream_with_the_keys_from_its_environment(
    keys: dict[str, str],
) -> None:
    ep, rp = tcp_pair()
    pub = ZmqEventPublisher.open(
        bind=True, endpoint=ep, replay_endpoint=rp, curve_secret_key_file=keys["server_secret"]
    )
    env = {
        **os.environ,
        CURVE_SERVER_KEY_ENV: keys["server"],
        CURVE_CLIENT_KEY_ENV: keys["client_secret"],
    }
    cmd = [sys.executable, "-m", "kvconnect.cli", "events", "tail", "--endpoint", ep]
    proc = subprocess.Popen(
        [*cmd, "--replay", rp, "--from-seq", "0", "--json"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        for i in range(3):
            pub.publish(make_batch(i))
        assert proc.stdout is not None
        assert [json.loads(proc.stdout.readline())["seq"] for _ in range(3)] == [0, 1, 2]
    finally:
        proc.kill()
        proc.wait()
        pub.shutdown()
    assert curve_from_env({}) is None
    with pytest.raises(ValueError, match="set both"):
        curve_from_env({CURVE_SERVER_KEY_ENV: keys["server"]})
