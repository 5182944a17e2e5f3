"""What a client may make the router do with `kv_transfer_params`, and what a request's options
may do to the index (issue 46: F10, F11). One `kvconnect serve` with a cpu tier and a peer
config, behind two routers: one as deployed (the default) and one with
`--trust-client-kv-params` (its clients are proxies).

    a client's do_remote_decode through the default router   dropped: no lease is granted,
                                                              the answer names no peer
    a client's remote_kv_source naming an unconfigured peer  dropped: a 200 computed, where
                                                              serve itself answers 400
    the same through the trusting router                     relayed: the lease and its
                                                              params come back
    a prompt_logprobs request for a prefix the index holds   computed whole (as vLLM), the
                                                              index keeps the prefix
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvconnect.transfer_params import TO_PREFILL
from tests.helpers import free_port, wait_for
from tests.peer_fakes import peer_config, prompt
from tests.serving import RouterProcess, Serve, get, post

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Serve, RouterProcess, RouterProcess]]:
    tmp: Path = tmp_path_factory.mktemp("kv-params")
    server = Serve(
        tmp, "--kv-transfer-config", peer_config(free_port()), "--enable-prompt-tokens-details"
    )
    server.start()
    plain = RouterProcess(tmp, [server])
    trusting = RouterProcess(tmp, [server], "--trust-client-kv-params")
    try:
        plain.start()
        trusting.start()
        yield server, plain, trusting
    finally:
        plain.stop()
        trusting.stop()
        assert server.stop() == 0, server.logs()


def complete(url: str, tokens: list[int], **extra: Any) -> dict[str, Any]:
    status, body, _ = post(
        url + "/v1/completions",
        {"model": "tiny", "prompt": tokens, "max_tokens": 4, "temperature": 0, **extra},
    )
    assert status == 200, body
    assert isinstance(body, dict)
    return body


def metric(url: str, name: str) -> float:
    status, text = get(url + "/metrics")
    assert status == 200, text
    found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_clients_own_kv_transfer_params_are_dropped_by_the_router(
    setup: tuple[Serve, RouterProcess, RouterProcess],
) -> None:
    """Through the router as deployed, a client's do_remote_decode leases nothing and its
    answer names no peer host, port or lease; its remote_kv_source is not relayed (serve would
    refuse it with a 400: not one of its peers), so the request is computed."""
    server, plain, _ = setup
    granted = metric(server.url, "kvconnect_connector_num_leases_granted_total")
    answer = complete(plain.url, prompt(1), kv_transfer_params=TO_PREFILL)
    assert "kv_transfer_params" not in answer
    impostor = {"remote_kv_source": {"host": "127.0.0.1", "port": free_port()}}
    status, body, _ = post(
        server.url + "/v1/completions",
        {"model": "tiny", "prompt": prompt(2), "max_tokens": 4, "kv_transfer_params": impostor},
    )
    assert status == 400 and body["error"]["param"] == "kv_transfer_params", body
    answer = complete(plain.url, prompt(2), kv_transfer_params=impostor)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    complete(server.url, [1, 2, 3])  # the workers report their counts with a step's output
    assert metric(server.url, "kvconnect_connector_num_leases_granted_total") == granted


def test_a_trusting_router_relays_them_as_a_proxy_would(
    setup: tuple[Serve, RouterProcess, RouterProcess],
) -> None:
    server, _, trusting = setup
    answer = complete(trusting.url, prompt(3), kv_transfer_params=TO_PREFILL)
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_request_id"]

    def granted() -> bool:
        complete(server.url, [1, 2, 3])
        return metric(server.url, "kvconnect_connector_num_leases_granted_total") >= 1

    wait_for(granted, timeout=30, what="the relayed lease granted")


def held_tokens(router: RouterProcess, tokens: list[int]) -> int:
    status, body, _ = post(router.url + "/kv/score", {"prompt": tokens})
    assert status == 200, body
    return int(next(iter(body["instances"].values()))["cached_tokens"])


def stale_entries(router: RouterProcess) -> float:
    status, text = get(router.url + "/metrics")
    assert status == 200, text
    return sum(
        float(v)
        for v in re.findall(r"^kvconnect_router_index_stale_total\{[^}]*\} (\S+)$", text, re.M)
    )


def test_a_request_asking_for_prompt_logprobs_leaves_the_index_as_it_was(
    setup: tuple[Serve, RouterProcess, RouterProcess],
) -> None:
    """The engine computes a prompt_logprobs request whole (its answer counts 0 cached
    tokens), as vLLM does; the router must not take that for entries the instance lost and
    drop them (they came back only when some later request computed the prefix again)."""
    _, plain, _ = setup
    tokens = prompt(4)
    complete(plain.url, tokens)
    wait_for(lambda: held_tokens(plain, tokens) >= 144, timeout=30, what="the prefix indexed")
    held, stale = held_tokens(plain, tokens), stale_entries(plain)
    answer = complete(plain.url, tokens, prompt_logprobs=1)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    answer = complete(plain.url, tokens, echo=True, logprobs=1)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert stale_entries(plain) == stale
    assert held_tokens(plain, tokens) == held
    assert complete(plain.url, tokens)["usage"]["prompt_tokens_details"]["cached_tokens"] == held
