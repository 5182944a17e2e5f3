"""Event discovery (vLLM PR #55844): `kvconnect serve` with OS-chosen event ports names its
streams at GET /kv_event_sources, and `kvconnect router --instance URL` follows them."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvconnect.events import BlockStored
from kvconnect.stream.subscriber import KVEventSubscriber, ReceivedBatch
from tests import helpers
from tests.serving import RouterProcess, Serve, get, post, request

pytestmark = pytest.mark.slow

LONG = "A long shared system prompt for discovery tests. " * 12
PORT_ZERO = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:0"})


class DiscoveredServe(Serve):
    """`kvconnect serve` whose event ports are the OS's; the router is given its URL alone."""

    def __init__(self, tmp: Path, *extra: str) -> None:
        super().__init__(tmp, "--kv-events-config", PORT_ZERO, *extra)

    @property
    def instance(self) -> str:
        return self.url


@pytest.fixture(scope="module")
def discovered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[DiscoveredServe]]:
    tmp = tmp_path_factory.mktemp("discovered")
    engines = [DiscoveredServe(tmp, "--enable-prompt-tokens-details") for _ in range(2)]
    try:
        for e in engines:
            e.start()
        yield engines
    finally:
        for e in engines:
            assert e.stop() == 0, e.logs()


def test_serve_with_port_zero_names_its_bound_streams_and_a_subscriber_reads_them(
    discovered: list[DiscoveredServe],
) -> None:
    engine = discovered[0]
    status, sources = get(engine.url + "/kv_event_sources")
    assert status == 200, sources
    assert [sorted(s) for s in sources] == [
        ["data_parallel_rank", "endpoint", "replay_endpoint", "topic"]
    ]
    (source,) = sources
    assert (source["data_parallel_rank"], source["topic"]) == (0, "")
    # The wildcard host is given as the address the request came in on; ports are the OS's.
    for key in ("endpoint", "replay_endpoint"):
        host, _, port = source[key].removeprefix("tcp://").rpartition(":")
        assert (host, port != "0") == ("127.0.0.1", True), source
    assert source["endpoint"] != source["replay_endpoint"]
    assert f"KV events {source['endpoint'].replace('127.0.0.1', '0.0.0.0')}" in engine.ready_line

    sub = KVEventSubscriber(source["endpoint"], source["replay_endpoint"], start_seq=0)
    try:
        prompt = {"prompt": "z" * 40, "max_tokens": 1}
        status, body, _ = post(engine.url + "/v1/completions", prompt)
        assert status == 200, body
        stored: list[BlockStored] = []
        end = time.monotonic() + 10
        while not stored and time.monotonic() < end:
            item = sub.recv(timeout=0.5)
            if isinstance(item, ReceivedBatch):
                stored += [e for e in item.batch.events if isinstance(e, BlockStored)]
        assert stored and stored[0].medium in (None, "GPU")
    finally:
        sub.close()


def test_a_router_given_only_urls_discovers_the_streams_and_routes_by_prefix(
    discovered: list[DiscoveredServe], tmp_path: Path
) -> None:
    router = RouterProcess(tmp_path, list(discovered))
    router.start()
    try:
        status, body, headers = post(
            router.url + "/v1/completions", {"prompt": LONG + "one", "max_tokens": 2}
        )
        assert status == 200, body
        where = headers["x-kvconnect-instance"]

        def held() -> bool:
            _, score, _ = post(router.url + "/kv/score", {"prompt": LONG + "one"})
            return bool(score["instances"][where]["cached_blocks"] > 0)

        helpers.wait_for(held, 20.0, interval=0.05)
        status, again, headers = post(
            router.url + "/v1/completions", {"prompt": LONG + "two", "max_tokens": 2}
        )
        assert status == 200, again
        assert headers["x-kvconnect-instance"] == where
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 30
        _, health = get(router.url + "/health")
        assert all(i["synced"] for i in health["instances"].values()), health
    finally:
        router.stop()


class _NoDiscovery(BaseHTTPRequestHandler):
    """An HTTP server that has no /kv_event_sources (as a server before PR #55844)."""

    def do_GET(self) -> None:
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def no_discovery() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", helpers.free_port()), _NoDiscovery)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class _UrlRouter(RouterProcess):
    def __init__(self, tmp: Path, urls: list[str], *extra: str) -> None:
        super().__init__(tmp, [], *extra)
        self.urls = urls

    def command(self) -> list[str]:
        args = ["router", "--model", "tiny", "--port", str(self.port)]
        for url in self.urls:
            args += ["--instance", url]
        return [*args, *self.extra]


def test_a_router_refuses_an_instance_url_that_does_not_name_its_streams(
    no_discovery: str, tmp_path: Path
) -> None:
    line = _UrlRouter(tmp_path, [no_discovery]).refusal(timeout=30)
    assert line == (
        f"kvconnect router: error: --instance {no_discovery}: GET /kv_event_sources answered "
        "404: the instance does not name its KV event streams; give them: "
        "--instance URL,EVENTS_ENDPOINT[,REPLAY_ENDPOINT]"
    )


def test_a_router_refuses_an_instance_url_that_never_answers(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{helpers.free_port()}"
    line = _UrlRouter(tmp_path, [url], "--discovery-timeout", "0.5").refusal(timeout=30)
    assert line.startswith(
        f"kvconnect router: error: --instance {url}: GET /kv_event_sources: no answer within "
        "0.5s (last: "
    ), line


def test_discovery_asks_with_the_instance_key_where_serve_wants_one(tmp_path: Path) -> None:
    engine = DiscoveredServe(tmp_path, "--api-key", "instance-secret")
    engine.start()
    try:
        assert get(engine.url + "/kv_event_sources")[0] == 401
        status, sources, _ = request(
            engine.url + "/kv_event_sources", headers={"Authorization": "Bearer instance-secret"}
        )
        assert status == 200 and len(sources) == 1, sources
        refused = _UrlRouter(tmp_path, [engine.url], "--allow-unauthenticated")
        assert refused.refusal(timeout=30).endswith(
            "GET /kv_event_sources answered 401: the instance wants a key (--instance-api-key)"
        )
        router = _UrlRouter(
            tmp_path,
            [engine.url],
            "--instance-api-key",
            "instance-secret",
            "--allow-unauthenticated",
        )
        router.start()
        try:
            _, health = get(router.url + "/health")
            assert list(health["instances"]) == [engine.url]
        finally:
            router.stop()
    finally:
        assert engine.stop() == 0, engine.logs()
