"""Placement with pulls (issue 33, item 1): a `kvconnect router` process in front of two
`kvconnect serve` processes with peer tiers, each named to the router with `peer=`.

    a prompt's first request              goes to one instance, H, which stores its chunks
    H busy with a long request            the same prompt goes to the idle instance, O, with
                                          remote_kv_source H: O pulls H's 4 chunks
                                          (cached_tokens 128) and answers as H did
    answers of several lengths            the router fits each instance's prefill time and
                                          the pull's, and shows them on /metrics
    --no-pulls                            the same state: H runs it (as before pulls)
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import free_port, wait_for
from tests.peer_fakes import peer_config, prompt
from tests.serving import RouterProcess, Serve, get, post, serving

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[Serve]]]:
    tmp = tmp_path_factory.mktemp("pulls")
    servers = []
    ports = (free_port(), free_port())  # each may pull from the other
    for port in ports:
        details = "--enable-prompt-tokens-details"
        spec = peer_config(port, [p for p in ports if p != port], timeout_s=2.0)
        servers.append(Serve(tmp, "--kv-transfer-config", spec, details, peer_port=port))
    with serving(servers):
        yield tmp, servers


@pytest.fixture
def router(
    pair: tuple[Path, list[Serve]], request: pytest.FixtureRequest
) -> Iterator[RouterProcess]:
    tmp, servers = pair
    r = RouterProcess(tmp, servers, *getattr(request, "param", ()))
    r.start()
    try:
        yield r
    finally:
        r.stop()


def complete(url: str, tokens: list[int], max_tokens: int = 8) -> tuple[str, int, str]:
    status, body, headers = post(
        url + "/v1/completions",
        {"model": "tiny", "prompt": tokens, "max_tokens": max_tokens, "temperature": 0,
         "ignore_eos": True},
        timeout=120,
    )  # fmt: skip
    assert status == 200, body
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    return body["choices"][0]["text"], cached, headers.get("x-kvconnect-instance", "")


def metrics(url: str) -> str:
    status, text = get(url + "/metrics")
    assert status == 200, text
    return str(text)


def value(text: str, name: str, **labels: str) -> float | None:
    for found in re.finditer(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', found.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(found.group(2))
    return None


def held_by(router: RouterProcess, server: Serve, tokens: list[int], num: int) -> None:
    """Until `server` has stored `tokens`' chunks in its cpu tier and the router's index
    credits it with at least `num` of them."""

    def credited() -> bool:
        status, body, _ = post(router.url + "/kv/score", {"prompt": tokens})
        assert status == 200, body
        return bool(body["instances"][server.url]["cached_tokens"] >= num)

    wait_for(credited, timeout=30, what=f"{server.url} credited {num} tokens")
    wait_for(
        lambda: (
            (value(metrics(server.url), "kvconnect_connector_num_chunks_stored_total") or 0)
            >= num // 32
        ),
        timeout=30,
        what="chunks stored",
    )


def busy(router: RouterProcess, holder: str, tokens: list[int]) -> threading.Thread:
    """A long request for `tokens` through the router, in flight at `holder` once this
    returns (the router's own count)."""
    thread = threading.Thread(target=complete, args=(router.url, tokens, 500), daemon=True)
    thread.start()
    wait_for(
        lambda: value(metrics(router.url), "kvconnect_router_in_flight", instance=holder) == 1,
        timeout=30,
        what=f"a request in flight at {holder}",
    )
    return thread


def test_a_busy_holder_lends_its_prefix_to_the_idle_instance(
    pair: tuple[Path, list[Serve]], router: RouterProcess
) -> None:
    tokens = prompt(1)
    text, cached, holder = complete(router.url, tokens)
    assert cached == 0
    [other] = [s.url for s in pair[1] if s.url != holder]
    held_by(router, next(s for s in pair[1] if s.url == holder), tokens, 128)
    long = busy(router, holder, tokens)
    status, scored, _ = post(router.url + "/kv/score", {"prompt": tokens})  # what it would do
    assert status == 200 and scored["choice"]["instance"] == other, scored
    assert scored["choice"]["source"] == holder, scored
    costs = scored["choice"]["costs"]
    assert costs[other] < costs[holder], scored
    again, cached, went = complete(router.url, tokens)
    assert (went, cached, again) == (other, 128, text)  # pulled 4 chunks of 32, same answer
    text_m = metrics(router.url)
    assert value(text_m, "kvconnect_router_pulls_total", source=holder, instance=other) == 1
    long.join(120)


@pytest.mark.parametrize("router", [("--no-pulls",)], indirect=True)
def test_with_pulls_off_the_busy_holder_runs_it(
    pair: tuple[Path, list[Serve]], router: RouterProcess
) -> None:
    tokens = prompt(2)
    text, _, holder = complete(router.url, tokens)
    held_by(router, next(s for s in pair[1] if s.url == holder), tokens, 128)
    long = busy(router, holder, tokens)
    again, cached, went = complete(router.url, tokens)
    assert (went, again) == (holder, text) and cached >= 128  # today's choice: H, loaded
    assert value(metrics(router.url), "kvconnect_router_pulls_total") is None
    long.join(120)


def test_the_router_learns_each_instances_prefill_time_and_shows_it(
    pair: tuple[Path, list[Serve]], router: RouterProcess
) -> None:
    for seed, n in enumerate((64, 2048, 256, 1536, 512, 1024, 128, 3000) * 2):
        complete(router.url, prompt(100 + seed, n), max_tokens=4)
    text = metrics(router.url)
    fitted = {
        s.url: value(text, "kvconnect_router_prefill_seconds_per_token", instance=s.url)
        for s in pair[1]
    }
    assert any(v is not None and v > 0 for v in fitted.values()), text


LENGTHS = (64, 2048, 256, 1536, 512, 1024, 128, 3000)


def test_streamed_answers_with_a_usage_chunk_are_measured_too(
    pair: tuple[Path, list[Serve]], router: RouterProcess
) -> None:
    """A streamed answer that ends with its usage (stream_options.include_usage) measures
    its instance as a whole one does: the time to its first token, against the prompt
    tokens it computed. Without the usage chunk, nothing is learned. (Eight answers: one
    instance gets at least four, MIN_ANSWERS.)"""
    for seed, n in enumerate(LENGTHS):
        body = {"model": "tiny", "prompt": prompt(300 + seed, n), "max_tokens": 4,
                "temperature": 0, "stream": True}  # fmt: skip
        status, text, _ = post(router.url + "/v1/completions", body)
        assert status == 200 and str(text).rstrip().endswith("data: [DONE]"), text
    before = metrics(router.url)
    assert value(before, "kvconnect_router_prefill_seconds_per_token") is None, before
    for seed, n in enumerate(LENGTHS):
        body = {"model": "tiny", "prompt": prompt(400 + seed, n), "max_tokens": 4,
                "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        status, text, _ = post(router.url + "/v1/completions", body)
        assert status == 200 and '"prompt_tokens_details"' in str(text), text
    text = metrics(router.url)
    fitted = [
        value(text, "kvconnect_router_prefill_seconds_per_token", instance=s.url) for s in pair[1]
    ]
    assert any(v is not None and v > 0 for v in fitted), text


def burst(router: RouterProcess, tokens_of: list[list[int]]) -> list[tuple[str, int, str]]:
    """Every prompt sent at once (a barrier), each answer's (text, cached, instance)."""
    barrier = threading.Barrier(len(tokens_of))
    answers: list[tuple[str, int, str] | None] = [None] * len(tokens_of)

    def one(i: int) -> None:
        barrier.wait()
        answers[i] = complete(router.url, tokens_of[i], max_tokens=2)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(tokens_of))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(a is not None for a in answers)
    return [a for a in answers if a is not None]


def test_a_burst_sharing_a_new_prefix_computes_it_once(
    pair: tuple[Path, list[Serve]], router: RouterProcess
) -> None:
    """Six requests sharing a new 512-token prefix, sent together: the first is computed
    on one instance; the others wait for its prefix there (its events), then are routed to
    it or pull it: one instance computes the 512 tokens, not both."""
    shared = prompt(10, 512)
    prompts = [shared + prompt(20 + i, 16) for i in range(6)]
    answers = burst(router, prompts)
    computed = sum(len(p) - cached for p, (_, cached, _) in zip(prompts, answers, strict=True))
    assert computed <= 512 + 6 * 16 + 6 * 32, answers  # + each suffix's block and chunk
    text = metrics(router.url)
    waited = sum(
        v or 0
        for o in ("held", "ended")
        if (v := value(text, "kvconnect_router_prefill_waits_total", outcome=o))
    )
    assert waited >= 1, text


def test_a_restarted_instance_gets_its_first_prefixes_by_pulling_them(
    pair: tuple[Path, list[Serve]], router: RouterProcess
) -> None:
    """Item 4, warm new instances: O, which held a prompt of its own, restarts empty (the
    router drops its entries on its publisher's restart) while H holds a prompt and is
    busy; O's first request for H's prompt pulls H's 4 chunks instead of computing them,
    and answers as H did."""
    tokens = prompt(3)
    text, _, holder = complete(router.url, tokens)
    h = next(s for s in pair[1] if s.url == holder)
    [o] = [s for s in pair[1] if s.url != holder]
    held_by(router, h, tokens, 128)
    own = prompt(4)
    complete(o.url, own)  # straight to O: its stream has published, its restart shows
    held_by(router, o, own, 128)
    before = value(metrics(router.url), "kvconnect_router_publisher_restarts_total") or 0
    o.kill()
    o.start()

    def o_is_back() -> bool:
        text = metrics(router.url)
        restarts = value(text, "kvconnect_router_publisher_restarts_total") or 0
        up = value(text, "kvconnect_router_instance_up", instance=o.url) == 1
        return restarts > before and up

    wait_for(o_is_back, timeout=60, what=f"{o.url} back in rotation, its old entries dropped")
    _, scored, _ = post(router.url + "/kv/score", {"prompt": own})
    assert scored["instances"][o.url]["cached_tokens"] == 0, scored
    long = busy(router, holder, tokens)
    again, cached, went = complete(router.url, tokens)
    assert (went, cached, again) == (o.url, 128, text)
    text_m = metrics(router.url)
    assert value(text_m, "kvconnect_router_pulls_total", source=holder, instance=o.url), text_m
    long.join(120)
