"""Clients that leave, floods, and what a tenant learns: `kvconnect serve` on its own and two
instances behind `kvconnect router` (real processes, real sockets).

    a client that disconnects      its engine requests are aborted and their blocks freed,
                                   non-streaming too, directly and through the router
    a flood of huge requests       refused at once with 503 + Retry-After over the waiting
                                   limits, while a one-token request is still served
    cached_tokens                  absent unless --enable-prompt-tokens-details
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.serving import RouterProcess, Serve, get, post

pytestmark = pytest.mark.slow

WAITING_TOKENS = 30_000
"""A flood request is 64 prompts of 400 tokens: 25,600 tokens. The waiting total is a sum of
such prompts, so it never passes 29,600 once admitted, and a 2-token request always fits."""
FLOOD_PROMPT = "z" * 400  # the byte model: one token per byte, no BOS


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[Serve], RouterProcess]]:
    tmp = tmp_path_factory.mktemp("limits")
    limits = ("--max-model-len", "4096", "--max-num-waiting-tokens", str(WAITING_TOKENS))
    servers = [Serve(tmp, *limits) for _ in range(2)]
    for s in servers:
        s.start()
    router = RouterProcess(tmp, servers)
    try:
        router.start()
        yield servers, router
    finally:
        router.stop()
        for s in servers:
            assert s.stop() == 0, s.logs()


def metric(url: str, name: str) -> float:
    status, text = get(url + "/metrics")
    assert status == 200, text
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in {url}/metrics")


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Ask until `condition()` holds (each ask is an HTTP round trip: no sleep needed)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"


def open_long_request(port: int, stream: bool) -> socket.socket:
    """A request that would generate for minutes, sent on a raw socket that we then close."""
    body = json.dumps(
        {"prompt": "q" * 100, "max_tokens": 3900, "ignore_eos": True, "stream": stream}
    ).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return s


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("via", ["serve", "router"])
def test_a_client_that_leaves_aborts_its_request_and_frees_its_blocks(
    served: tuple[list[Serve], RouterProcess], via: str, stream: bool
) -> None:
    servers, router = served
    running = "vllm:num_requests_running"
    usage = "vllm:kv_cache_usage_perc"
    wait_for(lambda: all(metric(s.url, running) == 0 for s in servers), "idle instances")
    before = {s.url: metric(s.url, usage) for s in servers}
    client = open_long_request(servers[0].port if via == "serve" else router.port, stream)
    try:
        wait_for(lambda: sum(metric(s.url, running) for s in servers) == 1, "the request runs")
        busy = next(s for s in servers if metric(s.url, running) == 1)
        assert metric(busy.url, usage) > before[busy.url]  # it holds blocks now
    finally:
        client.close()
    # 3,900 tokens would take minutes: only the abort ends it this soon.
    wait_for(lambda: metric(busy.url, running) == 0, "the engine request is aborted")
    assert metric(busy.url, usage) == before[busy.url]
    assert metric(busy.url, "vllm:num_requests_waiting") == 0


def flood_request(url: str) -> tuple[int, str | None, object]:
    body = {"prompt": [FLOOD_PROMPT] * 64, "max_tokens": 8, "ignore_eos": True}
    status, answer, headers = post(url + "/v1/completions", body, timeout=120)
    return status, headers.get("Retry-After"), answer


@pytest.mark.parametrize("via", ["serve", "router"])
def test_a_flood_is_refused_with_503_while_a_small_request_is_served(
    served: tuple[list[Serve], RouterProcess], via: str
) -> None:
    servers, router = served
    url = servers[0].url if via == "serve" else router.url
    refused, done = threading.Event(), threading.Event()
    results: list[tuple[int, str | None, object]] = []

    def flood() -> None:
        for _ in range(100):
            if done.is_set():
                return
            result = flood_request(url)
            results.append(result)
            if result[0] == 503:
                refused.set()

    with ThreadPoolExecutor(6) as pool:
        floods = [pool.submit(flood) for _ in range(6)]
        try:
            assert refused.wait(120), Counter(r[0] for r in results)
            # The flood goes on: a well-behaved client's one-token request gets its answer.
            status, answer, _ = post(url + "/v1/completions", {"prompt": "hi", "max_tokens": 1})
            assert not done.is_set()
        finally:
            done.set()
        assert status == 200, answer
        assert answer["usage"]["completion_tokens"] == 1
        for f in floods:
            f.result()
    statuses = Counter(r[0] for r in results)
    assert set(statuses) == {200, 503}, statuses
    for status, retry_after, answer in results:
        if status == 503:
            assert retry_after == "1"
            assert answer["error"]["type"] == "service_unavailable"  # type: ignore[index]
            assert "--max-num-waiting-tokens" in answer["error"]["message"]  # type: ignore[index]


def test_cached_tokens_are_not_told_without_the_flag(
    served: tuple[list[Serve], RouterProcess],
) -> None:
    servers, router = served
    prompt = "A prefix another tenant sent. " * 4
    for url in (servers[0].url, router.url):
        for _ in range(2):
            status, answer, _ = post(url + "/v1/completions", {"prompt": prompt, "max_tokens": 1})
            assert status == 200, answer
            assert "prompt_tokens_details" not in answer["usage"], answer["usage"]
    assert metric(servers[0].url, "vllm:prefix_cache_hits_total") > 0  # it did hit


def test_a_request_over_the_limits_alone_runs_when_nothing_waits(
    served: tuple[list[Serve], RouterProcess],
) -> None:
    """64 prompts of 480 tokens (30,720) is over the waiting limit of 30,000 by itself: it is
    admitted when nothing waits, or the protocol would allow a request no server runs."""
    servers, _ = served
    conn = http.client.HTTPConnection("127.0.0.1", servers[1].port, timeout=120)
    body = {"prompt": ["w" * 480] * 64, "max_tokens": 1}
    wait_for(lambda: metric(servers[1].url, "vllm:num_requests_running") == 0, "idle")
    conn.request("POST", "/v1/completions", json.dumps(body))
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    assert len(json.loads(resp.read())["choices"]) == 64
