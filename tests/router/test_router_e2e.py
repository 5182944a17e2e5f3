"""Two engine instances (`kvconnect serve` processes) behind the router, over HTTP."""

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from kvconnect.cluster import wait_healthy
from kvconnect.router.index import BlockIndex
from kvconnect.router.server import Instance, Router, make_app
from kvconnect.tokenizer import load_tokenizer
from tests.helpers import free_port

pytestmark = pytest.mark.slow


class Engine:
    def __init__(self) -> None:
        self.port, self.ev = free_port(), free_port(2)
        self.url = f"http://127.0.0.1:{self.port}"
        self.instance = Instance(
            self.url, f"tcp://127.0.0.1:{self.ev}", f"tcp://127.0.0.1:{self.ev + 1}"
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        events = {
            "enable_kv_cache_events": True,
            "endpoint": self.instance.events_endpoint,
            "replay_endpoint": self.instance.replay_endpoint,
            "bind": True,
        }
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvconnect.cli",
                "serve",
                "--model",
                "tiny",
                "--port",
                str(self.port),
                "--kv-events-config",
                json.dumps(events),
            ]
        )
        wait_healthy(self.url, self.proc, timeout=120)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def post(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.load(resp), resp.headers.get("x-kvconnect-instance", "")


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[list[Engine], Router, str]]:
    engines = [Engine(), Engine()]
    for e in engines:
        e.start()
    router = Router([e.instance for e in engines], BlockIndex(), load_tokenizer("tiny"))
    runner = web.AppRunner(make_app(router))
    loop = asyncio.new_event_loop()
    port = free_port()
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield engines, router, f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        for e in engines:
            e.stop()


LONG = "A long shared system prompt for routing tests. " * 12


def wait_for(pred: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_repeated_prompt_follows_its_cache_and_cold_prompt_avoids_load(
    cluster: tuple[list[Engine], Router, str],
) -> None:
    _, router, url = cluster
    _, where = post(url, {"prompt": LONG + "one", "max_tokens": 4})
    tokens = router.tokenizer.encode(LONG + "one")
    wait_for(
        lambda: (
            router.scores(tokens).get(where) is not None
            and router.scores(tokens)[where].num_blocks > 0
        )
    )
    again, where2 = post(url, {"prompt": LONG + "two", "max_tokens": 4})
    assert where2 == where and again["kv_cache"]["num_cached_tokens"] >= 16 * 30
    # Keep `where` busy with a long streaming request, then send a cold prompt.
    slow = threading.Thread(
        target=post, args=(url, {"prompt": LONG + "three", "max_tokens": 400, "ignore_eos": True})
    )
    slow.start()
    wait_for(lambda: router.in_flight[where] == 1)
    _, cold_where = post(url, {"prompt": "a completely different prompt " * 3, "max_tokens": 2})
    slow.join()
    assert cold_where != where
    with urllib.request.urlopen(url + "/metrics") as resp:
        metrics = resp.read().decode()
    assert 'kvconnect_router_hit_blocks_total{tier="GPU"}' in metrics
    with router.lock:
        router.index.check_integrity()


def test_streaming_passes_through(cluster: tuple[list[Engine], Router, str]) -> None:
    _, _, url = cluster
    body = json.dumps(
        {"prompt": "stream me", "max_tokens": 5, "stream": True, "ignore_eos": True}
    ).encode()
    req = urllib.request.Request(
        url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        lines = [ln for ln in resp.read().decode().split("\n\n") if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 5


def test_router_survives_an_instance_killed_and_restarted(
    cluster: tuple[list[Engine], Router, str],
) -> None:
    engines, router, url = cluster
    prompt = LONG + "restart"
    _, where = post(url, {"prompt": prompt, "max_tokens": 2})
    victim = next(e for e in engines if e.url == where)
    tokens = router.tokenizer.encode(prompt)
    hashes = router.index.request_hashes(tokens)
    vid = victim.instance.name
    wait_for(lambda: vid in router.index.holders(hashes[0]))
    victim.kill()
    _, where_now = post(url, {"prompt": prompt, "max_tokens": 2})  # refused, then elsewhere
    assert where_now != victim.url and router.failures[victim.url] >= 1
    victim.start()
    post(victim.url, {"prompt": "fresh after restart " * 4, "max_tokens": 2})
    fresh = router.index.request_hashes(router.tokenizer.encode("fresh after restart " * 4))
    wait_for(lambda: vid in router.index.holders(fresh[0]))  # rebuilt from the new stream
    assert vid not in router.index.holders(hashes[0])  # its old entries were dropped
    assert router.index.stats.restarts >= 1


def test_router_imports_no_torch() -> None:
    code = "import sys, kvconnect.router.server; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_engine_server_health_metrics_and_bad_requests(
    cluster: tuple[list[Engine], Router, str],
) -> None:
    engines, _, url = cluster
    engine = next(e for e in engines if e.proc is not None and e.proc.poll() is None)
    with urllib.request.urlopen(engine.url + "/health") as resp:
        assert json.load(resp) == {"status": "ok"}
    with urllib.request.urlopen(engine.url + "/metrics") as resp:
        text = resp.read().decode()
    for name in (
        "kvconnect_requests_total",
        "kvconnect_kv_event_batches_published_total",
        "kvconnect_kv_event_batches_dropped_total",
        'kvconnect_prefix_cache_hit_tokens_total{tier="GPU"}',
    ):
        assert name in text
    for bad in ({"max_tokens": 2}, {"prompt": "x", "max_tokens": 0}, {"prompt": [999]}):
        req = urllib.request.Request(engine.url + "/v1/completions", data=json.dumps(bad).encode())
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 400
    req = urllib.request.Request(url + "/v1/completions", data=b"not json")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400
