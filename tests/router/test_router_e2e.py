"""Two `kvconnect serve` processes behind a `kvconnect router` process, over HTTP and ZMQ:
routing by cached prefix and by load, and instances dying, hanging and coming back."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import helpers
from tests.serving import RouterProcess, Serve, get, post

pytestmark = pytest.mark.slow

LONG = "A long shared system prompt for routing tests. " * 12


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[list[Serve], RouterProcess]]:
    tmp = tmp_path_factory.mktemp("cluster")
    engines = [Serve(tmp, "--enable-prompt-tokens-details") for _ in range(2)]
    router = RouterProcess(tmp, engines)
    try:
        for e in engines:
            e.start()
        router.start()
        yield engines, router
    finally:
        router.stop()
        for e in engines:
            e.stop()


def complete(router: RouterProcess, prompt: str, **fields: Any) -> tuple[dict[str, Any], str]:
    status, body, headers = post(router.url + "/v1/completions", {"prompt": prompt, **fields})
    assert status == 200, body
    return body, headers["x-kvconnect-instance"]


@contextlib.contextmanager
def open_stream(router: RouterProcess, prompt: str, **fields: Any) -> Iterator[str]:
    """A streamed completion, open until the block ends (then dropped mid-answer); yields the
    instance it went to once its first token has come."""
    conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=60)
    try:
        body = json.dumps({"prompt": prompt, "stream": True, **fields})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        assert resp.readline().startswith(b"data: ")  # a token: the engine runs it
        yield str(resp.getheader("x-kvconnect-instance"))
    finally:
        conn.close()


def serve_metric(engine: Serve, name: str) -> float:
    _, text = get(engine.url + "/metrics")
    found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert found, name
    return float(found.group(1))


def cached_blocks(router: RouterProcess, prompt: str) -> dict[str, int]:
    status, body, _ = post(router.url + "/kv/score", {"prompt": prompt})
    assert status == 200, body
    return {name: s["cached_blocks"] for name, s in body["instances"].items()}


def metric(router: RouterProcess, name: str, instance: str | None = None) -> float:
    _, text = get(router.url + "/metrics")
    label = "" if instance is None else f'{{instance="{instance}"}}'
    found = re.search(rf"^{re.escape(name + label)} (\S+)$", text, re.M)
    assert found, (name, instance)
    return float(found.group(1))


def state(router: RouterProcess, instance: str) -> str:
    _, body = get(router.url + "/health")
    return str(body["instances"][instance]["state"])


def wait_for(pred: Callable[[], bool], timeout: float = 20.0) -> float:
    """Seconds until `pred()` held (asked every 20 ms: each ask is an HTTP request)."""
    return helpers.wait_for(pred, timeout, interval=0.02)


def test_repeated_prompt_follows_its_cache_and_cold_prompt_avoids_load(
    cluster: tuple[list[Serve], RouterProcess],
) -> None:
    engines, router = cluster
    _, where = complete(router, LONG + "one", max_tokens=4)
    wait_for(lambda: cached_blocks(router, LONG + "one")[where] > 0)
    again, where2 = complete(router, LONG + "two", max_tokens=4)
    assert where2 == where
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 30
    # Keep `where` busy with a long request, then send a cold prompt: it goes elsewhere. The
    # long one is streamed and dropped once the cold one is placed: its instance aborts it.
    with open_stream(router, LONG + "three", max_tokens=400, ignore_eos=True) as busy:
        assert busy == where
        wait_for(lambda: metric(router, "kvconnect_router_in_flight", where) == 1)
        # what it has to compute of that prompt (beyond the cached blocks) is counted there
        assert metric(router, "kvconnect_router_pending_prefill_tokens", where) > 0
        _, cold_where = complete(router, "a completely different prompt " * 3, max_tokens=2)
    assert cold_where != where
    wait_for(lambda: metric(router, "kvconnect_router_in_flight", where) == 0)
    for e in engines:  # every answer ended: nothing is left counted anywhere
        assert metric(router, "kvconnect_router_pending_prefill_tokens", e.url) == 0
    engine = next(e for e in engines if e.url == where)
    wait_for(lambda: serve_metric(engine, "vllm:num_requests_running") == 0)
    _, text = get(router.url + "/metrics")
    assert 'kvconnect_router_hit_blocks_total{tier="GPU"}' in text


def test_streaming_passes_through(cluster: tuple[list[Serve], RouterProcess]) -> None:
    _, router = cluster
    status, raw, _ = post(
        router.url + "/v1/completions",
        {
            "prompt": "stream me",
            "max_tokens": 5,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert status == 200
    lines = [ln for ln in raw.split("\n\n") if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 5


def test_logprobs_and_sampling_fields_pass_through_unchanged(
    cluster: tuple[list[Serve], RouterProcess],
) -> None:
    """The router's answer is the instance's own: the same request sent to the instance it
    chose gives the same logprobs, echo and prompt logprobs (greedy, so both are the same)."""
    engines, router = cluster
    fields = {
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 2,
        "echo": True,
        "frequency_penalty": 1.5,
        "logit_bias": {"66": 3.5},
        "min_tokens": 2,
        "bad_words": ["q"],
    }
    routed, where = complete(router, "pass me through", **fields)
    engine = next(e for e in engines if e.url == where)
    status, direct, _ = post(
        engine.url + "/v1/completions", {"prompt": "pass me through", **fields}
    )
    assert status == 200, direct
    mine, theirs = routed["choices"][0], direct["choices"][0]
    assert mine["logprobs"]["tokens"][:15] == list("pass me through")
    assert mine["logprobs"]["token_logprobs"][0] is None
    assert len(mine["prompt_logprobs"]) == 15
    for key in ("text", "logprobs", "prompt_logprobs"):
        assert mine[key] == theirs[key], key


def send_many(router: RouterProcess, n: int) -> list[str]:
    """Where `n` new cold prompts (cached nowhere) went."""
    tag = uuid.uuid4().hex
    return [complete(router, f"{i} {tag} " * 2, max_tokens=1)[1] for i in range(n)]


def test_a_killed_instance_leaves_rotation_before_any_request_and_rejoins(
    cluster: tuple[list[Serve], RouterProcess],
) -> None:
    engines, router = cluster
    prompt = LONG + "restart"
    _, where = complete(router, prompt, max_tokens=2)
    victim = next(e for e in engines if e.url == where)
    wait_for(lambda: cached_blocks(router, prompt)[where] > 0)
    failures = metric(router, "kvconnect_router_forward_failures_total", where)
    restarts = metric(router, "kvconnect_router_publisher_restarts_total")

    victim.kill()
    assert wait_for(lambda: state(router, where) == "down") < 2.0
    assert set(send_many(router, 10)) == {e.url for e in engines if e is not victim}
    # The health check took it out: no request was sent to it and refused.
    assert metric(router, "kvconnect_router_forward_failures_total", where) == failures

    victim.start()
    wait_for(lambda: state(router, where) == "up", timeout=5)
    # Its new publisher's first batches tell the router it restarted: its old entries go.
    complete(router, "fresh after restart " * 4, max_tokens=2)
    post(victim.url + "/v1/completions", {"prompt": "fresh after restart " * 4, "max_tokens": 2})
    wait_for(lambda: cached_blocks(router, "fresh after restart " * 4)[where] > 0)
    assert cached_blocks(router, prompt)[where] == 0
    assert metric(router, "kvconnect_router_publisher_restarts_total") > restarts
    assert where in send_many(router, 10)


def test_a_hung_instance_leaves_rotation_and_rejoins_when_it_resumes(
    cluster: tuple[list[Serve], RouterProcess],
) -> None:
    engines, router = cluster
    victim = engines[0]
    wait_for(lambda: all(state(router, e.url) == "up" for e in engines))
    os.killpg(victim.pid, signal.SIGSTOP)
    try:
        assert wait_for(lambda: state(router, victim.url) == "down") < 2.5
        assert victim.url not in send_many(router, 6)
    finally:
        os.killpg(victim.pid, signal.SIGCONT)
    wait_for(lambda: state(router, victim.url) == "up", timeout=5)


def test_router_imports_no_torch() -> None:
    """`kvconnect router`'s process: the CLI, its command, the router, its HTTP and tokenizer."""
    code = (
        "import sys, kvconnect.cli, kvconnect.commands.router, kvconnect.router.server; "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_instance_up_is_a_503_and_health_says_so(tmp_path: Path) -> None:
    nowhere = Serve(tmp_path)  # never started: its port refuses
    router = RouterProcess(tmp_path, [nowhere])
    router.start()
    try:
        wait_for(lambda: state(router, nowhere.url) == "down")
        assert get(router.url + "/health")[0] == 503
        status, body, _ = post(router.url + "/v1/completions", {"prompt": "x"})
        assert status == 503 and body["error"]["type"] == "service_unavailable"
        assert router.alive()
    finally:
        assert router.stop() == 0, router.logs()


def test_tokenize_detokenize_and_version_go_through(
    cluster: tuple[list[Serve], RouterProcess],
) -> None:
    engines, router = cluster
    status, body, headers = post(router.url + "/tokenize", {"prompt": "Hi there"})
    assert status == 200 and headers["x-kvconnect-instance"] in {e.url for e in engines}
    _, direct, _ = post(engines[0].url + "/tokenize", {"prompt": "Hi there"})
    assert body == direct and body["count"] == len(body["tokens"]) == len("Hi there")
    status, back, _ = post(router.url + "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back == {"prompt": "Hi there"}
    status, bad, _ = post(router.url + "/detokenize", {"tokens": "nope"})
    assert status == 400 and bad["error"]["param"] == "tokens"  # the instance's own answer
    status, version = get(router.url + "/version")
    assert status == 200 and isinstance(version["version"], str)


def test_replicas_count_each_others_requests_in_flight(
    cluster: tuple[list[Serve], RouterProcess], tmp_path: Path
) -> None:
    """Two replicas named to each other (`--replica`): a long request in flight through one
    at instance X makes the other send a prompt elsewhere that it would have sent to X. A
    third replica that is not told of them keeps choosing X: it counts only its own."""
    engines, _ = cluster
    first, second, alone = (RouterProcess(tmp_path, engines) for _ in range(3))
    first.extra = ("--replica", second.url)
    second.extra = ("--replica", first.url)
    try:
        for r in (first, second, alone):
            r.start()
        prompt = "a prompt no instance holds, for the replicas " + uuid.uuid4().hex

        def choice(router: RouterProcess) -> str:
            status, body, _ = post(router.url + "/kv/score", {"prompt": prompt})
            assert status == 200, body
            return str(body["choice"]["instance"])

        # idle, and once each has read the events still arriving from earlier tests (a tie
        # is broken by how many blocks each instance holds): the same choice
        wait_for(lambda: choice(first) == choice(second) == choice(alone))
        x = choice(first)
        with open_stream(first, prompt, max_tokens=400, ignore_eos=True) as busy:
            assert busy == x
            wait_for(lambda: choice(second) != x)  # it counts first's request at x
            _, text = get(second.url + "/kv/load")  # its own: none
            assert text["instances"] == {e.url: {"in_flight": 0, "pending": 0} for e in engines}
            assert choice(alone) == x
        wait_for(lambda: choice(second) == x)  # the request ended: counted no more
    finally:
        for r in (first, second, alone):
            r.stop()
