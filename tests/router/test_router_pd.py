"""P/D through the router (`--prefill-instance`, `--decode-instance`): two `kvconnect serve`
processes with peer configs behind a `kvconnect router` process. The router drives
NixlConnector's handshake (router/pd.py): P prefills with max_tokens 1 and answers its
kv_transfer_params, D gets the client's request with them, pulls P's chunks and answers.

    a 150-token prompt                 prefilled on P, D pulls 4 chunks (cached_tokens 128),
                                       the same answer as P's monolithic one, streamed too
    a prompt D lacks less of than the --pd-min-tail    D computes it alone ("local")
    a P answering malformed params     D computes (never a 400 for the client)
    P stopped                          D computes; the client still gets its answer
"""

from __future__ import annotations

import json
import re
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import free_port
from tests.peer_fakes import peer_config, prompt
from tests.serving import RouterProcess, Serve, get, post

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Serve, Serve, RouterProcess]]:
    tmp = tmp_path_factory.mktemp("pd")
    details = "--enable-prompt-tokens-details"
    p_port = free_port()
    p = Serve(tmp, "--kv-transfer-config", peer_config(p_port, timeout_s=2.0), details)
    d = Serve(
        tmp, "--kv-transfer-config", peer_config(free_port(), (p_port,), timeout_s=2.0), details
    )
    p.start()
    d.start()
    router = RouterProcess(tmp, [d], "--prefill-instance", p.instance, "--pd-min-tail", "64")
    try:
        router.start()
        yield p, d, router
    finally:
        router.stop()
        for s in (p, d):
            if s.proc is not None:
                assert s.stop() == 0, s.logs()


def complete(url: str, tokens: list[int], **extra: Any) -> tuple[str, int, str]:
    status, body, headers = post(
        url + "/v1/completions",
        {"model": "tiny", "prompt": tokens, "max_tokens": 8, "temperature": 0, **extra},
    )
    assert status == 200, body
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    return body["choices"][0]["text"], cached, headers.get("x-kvconnect-instance", "")


def pd_outcomes(router: RouterProcess) -> dict[str, float]:
    status, text = get(router.url + "/metrics")
    assert status == 200, text
    found = re.findall(r'^kvconnect_router_pd_total\{outcome="(\w+)"\} (\S+)$', text, re.M)
    return {k: float(v) for k, v in found}


def streamed_text(url: str, tokens: list[int]) -> str:
    body = json.dumps(
        {"model": "tiny", "prompt": tokens, "max_tokens": 8, "temperature": 0, "stream": True}
    ).encode()
    req = urllib.request.Request(
        url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    text = ""
    with urllib.request.urlopen(req, timeout=60) as resp:
        for line in resp:
            if line.startswith(b"data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_a_request_is_prefilled_on_p_and_decoded_on_d(
    pd: tuple[Serve, Serve, RouterProcess],
) -> None:
    p, d, router = pd
    tokens = prompt(1)
    text, cached, instance = complete(router.url, tokens)
    assert instance == d.url
    assert cached == 128  # D pulled P's 4 chunks of 32
    assert text == complete(p.url, tokens)[0]  # P's monolithic answer
    assert pd_outcomes(router)["disaggregated"] == 1
    tokens = prompt(2)
    assert streamed_text(router.url, tokens) == complete(p.url, tokens)[0]
    assert pd_outcomes(router)["disaggregated"] == 2


def test_a_short_tail_is_computed_on_d_alone(pd: tuple[Serve, Serve, RouterProcess]) -> None:
    p, d, router = pd
    before = pd_outcomes(router).get("local", 0)
    tokens = prompt(3, n=40)  # D lacks 40 tokens, under --pd-min-tail 64
    text, cached, instance = complete(router.url, tokens)
    assert (cached, instance) == (0, d.url)
    assert pd_outcomes(router)["local"] == before + 1
    assert text == complete(p.url, tokens)[0]


class MalformedPrefill(ThreadingHTTPServer):
    """A prefill instance whose answers carry kv_transfer_params D would refuse."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", free_port()), _MalformedHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _MalformedHandler(BaseHTTPRequestHandler):
    def _answer(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._answer({"status": "ok"})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": "x"}
        self._answer({"choices": [{"text": "?"}], "kv_transfer_params": params})

    def log_message(self, *_: Any) -> None:
        pass


def test_a_prefill_answering_malformed_params_leaves_d_to_compute(
    pd: tuple[Serve, Serve, RouterProcess], tmp_path: Path
) -> None:
    """D would answer such params with a 400 naming the key; the router never sends them."""
    p, d, _ = pd
    fake = MalformedPrefill()
    router = RouterProcess(
        tmp_path,
        [d],
        "--prefill-instance",
        f"{fake.url},tcp://127.0.0.1:{free_port()}",
        "--pd-min-tail",
        "64",
    )
    try:
        router.start()
        tokens = prompt(5)
        text, cached, _ = complete(router.url, tokens)
        assert (text, cached) == (complete(p.url, tokens)[0], 0)
        assert pd_outcomes(router)["prefill_failed"] == 1
        assert "answered malformed params" in router.logs()
    finally:
        router.stop()
        fake.shutdown()


def test_a_failed_prefill_leaves_d_to_compute(pd: tuple[Serve, Serve, RouterProcess]) -> None:
    """Runs last: it stops P."""
    p, _, router = pd
    tokens = prompt(4)
    expected = complete(p.url, tokens)[0]
    assert p.stop() == 0, p.logs()
    text, cached, _ = complete(router.url, tokens)
    assert (text, cached) == (expected, 0)
    outcomes = pd_outcomes(router)
    assert outcomes.get("prefill_failed", 0) + outcomes.get("no_prefill_instance", 0) >= 1
