"""What a peer, or anything on a peer's port, can do to an instance (issue 46), against real
`kvconnect serve` processes: A holds prompts, B may pull from A and from the tests' own
listeners and dead ports, all configured as B's sources (a request can name nothing else).

    a source that is an HTTP server, ZMTP or random bytes     each request computes; B lives
    a source that trickles a chunk's bytes                    only that request waits, for
                                                              its pull's deadline; others run
    twenty requests naming twenty dead sources at once        another tenant is not held up
    a source whose HAS answer claims a gigabyte               refused from its length
    a client of A's peer port that never reads its answers    A holds one answer, then closes
    hundreds of idle connections to A's peer port             A's descriptors stay bounded,
                                                              B still pulls from A
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import pytest

from kvconnect.connector.offload.common import chunk_key
from kvconnect.transfer_params import TO_PREFILL
from tests.helpers import free_port, wait_for
from tests.peer_fakes import (
    CHUNK,
    Reply,
    answer_of,
    fake_peer,
    greeted,
    hello_of,
    peer_config,
    prompt,
)
from tests.serving import Serve, get, post, request

pytestmark = pytest.mark.slow

DEAD = 20
EVIL = ("http_server", "zmtp1", "random", "trickle", "big_has")


class Hostile(NamedTuple):
    a: Serve
    b: Serve
    a_port: int
    evil: dict[str, int]
    """B's sources that the tests play: one port each, and A's HTTP port (a source someone
    configured with the wrong port)."""
    dead: list[int]
    """B's sources where nothing listens."""


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hostile]:
    tmp = tmp_path_factory.mktemp("peer-trust")
    a_port = free_port()
    evil = {name: free_port() for name in EVIL}
    dead = [free_port() for _ in range(DEAD)]
    details = "--enable-prompt-tokens-details"
    a = Serve(tmp, "--kv-transfer-config", peer_config(a_port, []), details)
    evil["a_http"] = a.port
    b_sources = [a_port, *evil.values(), *dead]
    b = Serve(tmp, "--kv-transfer-config", peer_config(free_port(), b_sources), details)
    a.start()
    try:
        b.start()
        try:
            yield Hostile(a, b, a_port, evil, dead)
        finally:
            assert b.stop() == 0, b.logs()
    finally:
        assert a.stop() == 0, a.logs()


def complete(server: Serve, tokens: list[int], **extra: Any) -> tuple[str, int]:
    status, body, _ = post(
        server.url + "/v1/completions",
        {"model": "tiny", "prompt": tokens, "max_tokens": 4, "temperature": 0, **extra},
    )
    assert status == 200, body
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def prefill(server: Serve, tokens: list[int]) -> dict[str, Any]:
    """P/D's first step at `server`: its answer's kv_transfer_params (they name its chunks)."""
    status, body, _ = post(
        server.url + "/v1/completions",
        {"model": "tiny", "prompt": tokens, "max_tokens": 1, "kv_transfer_params": TO_PREFILL},
    )
    assert status == 200, body
    params: dict[str, Any] = body["kv_transfer_params"]
    return params


def naming(port: int) -> dict[str, Any]:
    return {"kv_transfer_params": {"remote_kv_source": {"host": "127.0.0.1", "port": port}}}


class _BadRequest(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_error(400)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.mark.parametrize(
    ("kind", "seed"),
    [("a_http", 100), ("http_server", 110), ("zmtp1", 120), ("random", 130)],
)
def test_a_source_that_is_not_a_peer_fails_its_pull_and_the_instance_lives(
    hostile: Hostile, kind: str, seed: int
) -> None:
    """F1: an HTTP server on a source's port (A's own API; libzmq read its answers as
    ZMTP/1.0 frames and aborted the whole process within a few requests: `Assertion failed:
    !_more (src/fq.cpp:80)`), another HTTP server, ZMTP/1.0 frames or random bytes: every
    request naming it computes its prompt, and B serves on."""
    a, b, _, evil, _ = hostile
    port = evil[kind]
    greetings = {"zmtp1": b"\x03\x01ab\x03\x01cd\x02\x00e" * 4, "random": os.urandom(4096)}
    stop: Any = lambda: None  # noqa: E731
    if kind == "http_server":
        server = ThreadingHTTPServer(("127.0.0.1", port), _BadRequest)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        stop = server.shutdown
    elif kind != "a_http":
        peer = fake_peer(greeting=greetings[kind], hold=False, port=port)
        peer.__enter__()
        stop = lambda: peer.__exit__(None, None, None)  # noqa: E731
    try:
        for i in range(10):
            tokens = prompt(seed + i)
            expected, _ = complete(a, tokens)
            assert complete(b, tokens, **naming(port)) == (expected, 0)
    finally:
        stop()
    assert b.proc is not None and b.proc.poll() is None, b.logs()
    assert get(b.url + "/health")[0] == 200


def test_a_source_that_trickles_bytes_holds_only_its_own_request(hostile: Hostile) -> None:
    """F2: a source that says it holds the prompt, sends a chunk's head and then a byte every
    0.1 s. That request waits for its pull's deadline (timeout_s plus its bytes at the
    minimum rate: about a second) and computes; meanwhile another tenant's request runs at
    once. (Each recv's own timeout used to restart with every byte, on the I/O thread that
    the step waited on: every request of the instance stopped.)"""
    a, b, a_port, evil, _ = hostile
    hello = hello_of(a_port)
    asked, stop = threading.Event(), threading.Event()

    def trickle(verb: bytes, arg: bytes) -> Reply:
        if verb == b"S":
            return answer_of(msgspec.msgpack.encode(len(msgspec.msgpack.decode(arg))))

        def send(conn: socket.socket) -> None:
            asked.set()
            conn.sendall(b"K\x04" + b"".join(n.to_bytes(8, "big") for n in (9, 9, 9, 64)))
            while not stop.wait(0.1):
                conn.sendall(b"x")

        return send

    tokens, other = prompt(200), prompt(201)
    expected, _ = complete(a, tokens)
    other_expected, _ = complete(a, other)
    done: dict[str, float] = {}

    def slow() -> None:
        assert complete(b, tokens, **naming(evil["trickle"])) == (expected, 0)
        done["slow"] = time.monotonic()

    with fake_peer(trickle, hello=hello, port=evil["trickle"]):
        start = time.monotonic()
        thread = threading.Thread(target=slow)
        thread.start()
        try:
            assert asked.wait(30), "B never pulled"
            assert complete(b, other) == (other_expected, 0)
            done["other"] = time.monotonic()
            thread.join(60)
            assert not thread.is_alive()
        finally:
            stop.set()
    assert done["other"] < done["slow"]  # the other tenant did not wait for the pull
    assert done["slow"] - start < 10  # the pull's deadline, not the trickle's 20 s or more


def test_naming_dead_sources_at_once_does_not_hold_up_another_tenant(hostile: Hostile) -> None:
    """F3: twenty requests, each naming another configured source where nothing listens (a
    peer that died). Each lookup runs on its own source's thread, and none is ever joined on
    the step thread (the 17th source used to evict a lookup that way, for seconds), so
    another tenant's prompt is answered in its usual time while they wait out theirs."""
    a, b, _, _, dead = hostile
    prompts = [prompt(300 + i) for i in range(DEAD)]
    expected = [(complete(a, tokens)[0], 0) for tokens in prompts]
    results: dict[int, tuple[str, int]] = {}

    def ask(i: int) -> None:
        results[i] = complete(b, prompts[i], **naming(dead[i]))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(DEAD)]
    for t in threads:
        t.start()
    start = time.monotonic()
    complete(b, prompt(399))
    took = time.monotonic() - start
    for t in threads:
        t.join(60)
    assert [results[i] for i in range(DEAD)] == expected
    assert took < 1.0, took  # a tiny model's prompt; every dead lookup's timeout is 1 s


def rss(server: Serve) -> int:
    assert server.proc is not None
    with open(f"/proc/{server.proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_has_answer_claiming_a_gigabyte_is_refused_from_its_length(hostile: Hostile) -> None:
    """F6: a source answers a lookup's HAS with a part announced at 1 GiB and starts sending
    it: B refuses it from the length, reads none of it, and computes."""
    a, b, a_port, evil, _ = hostile
    hello = hello_of(a_port)

    def huge(verb: bytes, arg: bytes) -> Reply:
        def send(conn: socket.socket) -> None:
            conn.sendall(b"K\x01" + (1 << 30).to_bytes(8, "big"))
            zeros = bytes(1 << 20)
            for _ in range(1024):
                conn.sendall(zeros)

        return send

    tokens = prompt(400)
    expected, _ = complete(a, tokens)
    before = rss(b)
    with fake_peer(huge, hello=hello, port=evil["big_has"]):
        assert complete(b, tokens, **naming(evil["big_has"])) == (expected, 0)
    assert rss(b) - before < 64 << 20
    assert "an answer part of 1073741824 bytes" in b.logs()


def fds(server: Serve) -> int:
    assert server.proc is not None
    return len(os.listdir(f"/proc/{server.proc.pid}/fd"))


def test_a_client_of_the_peer_port_that_never_reads_holds_one_answer_then_is_closed(
    hostile: Hostile,
) -> None:
    """F7: a connection to A's peer port asks for a chunk A holds two thousand times and reads
    none of it: A's thread for it holds one answer at a time, gives up at that answer's
    deadline and closes the connection; B still pulls from A meanwhile."""
    a, b, a_port, _, _ = hostile
    tokens = prompt(500)
    expected, _ = complete(a, tokens)
    chunk = prefill(a, tokens)["remote_chunk_hashes"][0]  # the name of a chunk A holds
    key = chunk_key(hello_of(a_port).namespace, 1, 0, bytes.fromhex(chunk)).encode()
    before = rss(a)
    with greeted(a_port) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall((b"G" + len(key).to_bytes(4, "big") + key) * 2000)
        assert complete(b, tokens, **naming(a_port)) == (expected, 128)
        s.settimeout(30)
        with pytest.raises((ConnectionResetError, BrokenPipeError)):
            while s.recv(1 << 16):  # A closes it at its deadline, with answers unread
                time.sleep(0.2)
    assert rss(a) - before < 64 << 20


def test_idle_connections_to_the_peer_port_cannot_hold_its_descriptors(hostile: Hostile) -> None:
    """F8, F9: three hundred connections to A's peer port that do nothing. A holds at most its
    `max_connections` (128) of them, closing the longest idle one for each new one, so its
    descriptors stay bounded, its API answers, and B still pulls from A."""
    a, b, a_port, _, _ = hostile
    tokens = prompt(600)
    expected, _ = complete(a, tokens)
    before = fds(a)
    idle = []
    for _ in range(300):  # past the greeting, then silent
        with contextlib.suppress(OSError):
            idle.append(greeted(a_port))
    try:
        wait_for(lambda: fds(a) <= before + 128, timeout=30, what="A's descriptors bounded")
        assert get(a.url + "/health")[0] == 200
        time.sleep(0.6)  # long enough idle for a new connection to make room
        assert complete(b, tokens, **naming(a_port)) == (expected, 128)
    finally:
        for s in idle:
            s.close()


def test_the_instances_stay_whole(hostile: Hostile) -> None:
    """After all of the above, both instances answer as before."""
    a, b, a_port, _, _ = hostile
    tokens = prompt(700)
    expected, _ = complete(a, tokens)
    assert complete(b, tokens, **naming(a_port)) == (expected, 128)


def test_leases_have_quotas_per_instance_and_per_client(tmp_path: Path) -> None:
    """F5: a prefill instance whose cpu tier holds 16 chunks leases at most 8 of them
    (`max_leased_share` 0.5) and at most 4 to one client (`max_leased_share_per_client`
    0.25, a client being the API key it came with). Past either, a request runs without a
    lease (counted), and the rest of the tier still stores everyone's prompts (sixteen
    leases used to pin all of it: every other tenant's store failed)."""
    chunk_bytes = 4 * 2 * CHUNK * 4 * 32 * 4  # tiny: layers, K/V, tokens, KV heads, dim, fp32
    extra = {
        "chunk_size": CHUNK,
        "tiers": [{"kind": "cpu", "max_bytes": 16 * chunk_bytes}],
        "peer": {"port": free_port(), "max_leased_share_per_client": 0.25},
    }
    transfer = {"kv_connector": "OffloadConnector", "kv_role": "kv_both"}
    spec = json.dumps({**transfer, "kv_connector_extra_config": extra})
    p = Serve(tmp_path, "--kv-transfer-config", spec, "--api-key", "key-x", "key-y")
    p.start()

    def ask(key: str, seed: int, **extra: Any) -> dict[str, Any]:
        status, body, _ = request(
            p.url + "/v1/completions",
            {"model": "tiny", "prompt": prompt(seed), "max_tokens": 1, **extra},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert status == 200, body
        assert isinstance(body, dict)
        return body

    def counted(name: str) -> float:
        ask("key-x", 999)  # a step: the workers report their counts with its output
        _, text, _ = request(p.url + "/metrics", headers={"Authorization": "Bearer key-x"})
        found = re.search(rf"^kvconnect_connector_{name}_total\{{[^}}]*\}} (\S+)$", text, re.M)
        return float(found.group(1)) if found else 0.0

    try:
        for key, seed, granted, refused in [
            ("key-x", 1, 1, 0),  # x: 4 chunks, its quarter
            ("key-x", 2, 1, 1),  # x: 4 more would be 8: refused, runs without a lease
            ("key-y", 3, 2, 1),  # y: 4 (8 of 16 leased: the instance's half)
            ("key-y", 4, 2, 2),  # y: over both quotas
        ]:
            params = ask(key, seed, kv_transfer_params=TO_PREFILL)["kv_transfer_params"]
            assert len(params["remote_chunk_hashes"]) == 4  # answered all the same

            def settled(g: int = granted, r: int = refused) -> bool:
                return (counted("num_leases_granted"), counted("num_leases_refused")) == (g, r)

            wait_for(settled, timeout=30, what=f"{granted} granted, {refused} refused")
        stored = counted("num_chunks_stored")
        for seed in (5, 6, 7):  # another tenant: 12 chunks, into the 8 slots not leased
            ask("key-x", seed)
        wait_for(lambda: counted("num_chunks_stored") >= stored + 12, timeout=30, what="stores")
        assert counted("num_cpu_errors") == 0  # no store found every slot leased
    finally:
        assert p.stop() == 0, p.logs()
