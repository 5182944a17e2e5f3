"""`--api-key` and `--admin-token` on `kvconnect serve` and `kvconnect router` (real processes):
Bearer tokens or a 401 in OpenAI's shape, /health open, the admin paths behind their own token,
and the router either forwarding the client's key or presenting its own to the instances."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvconnect.http.auth import BearerAuth, api_key_from, api_keys_from, client_of, secret_from
from tests.serving import RouterProcess, Serve, request

pytestmark = pytest.mark.slow

KEY, ADMIN, ROUTER_KEY = "instance-key-1", "admin-token-2", "router-key-3"
COMPLETION = {"prompt": "hi", "max_tokens": 1}


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Serve, RouterProcess, RouterProcess]]:
    tmp = tmp_path_factory.mktemp("auth")
    server = Serve(tmp, "--api-key", KEY, "--admin-token", ADMIN)
    server.start()
    forwarding = RouterProcess(tmp, [server], "--api-key", KEY, "--admin-token", ADMIN)
    own_key = RouterProcess(tmp, [server], "--api-key", ROUTER_KEY, "--instance-api-key", KEY)
    try:
        forwarding.start()
        own_key.start()
        yield server, forwarding, own_key
    finally:
        own_key.stop()
        forwarding.stop()
        server.stop()


def call(
    url: str, authorization: str | None, body: dict[str, Any] | None = None
) -> tuple[int, Any, Any]:
    return request(url, body, None if authorization is None else {"Authorization": authorization})


@pytest.mark.parametrize("which", ["serve", "router"])
def test_without_the_key_every_path_but_health_is_a_401(
    served: tuple[Serve, RouterProcess, RouterProcess], which: str
) -> None:
    target = served[0] if which == "serve" else served[1]
    for authorization in (None, "Bearer wrong", f"Basic {KEY}", "Bearer", f"Bearer {KEY}x"):
        status, body, headers = call(target.url + "/v1/completions", authorization, COMPLETION)
        assert status == 401, (authorization, body)
        assert body["error"]["code"] == "invalid_api_key"
        assert headers["WWW-Authenticate"] == "Bearer"
        for path in ("/v1/models", "/version", "/metrics"):
            assert call(target.url + path, authorization)[0] == 401, path
    assert call(target.url + "/health", None)[0] == 200


@pytest.mark.parametrize("which", ["serve", "router"])
def test_the_key_opens_the_api_and_the_admin_token_the_admin_paths(
    served: tuple[Serve, RouterProcess, RouterProcess], which: str
) -> None:
    target = served[0] if which == "serve" else served[1]
    status, body, _ = call(target.url + "/v1/completions", f"Bearer {KEY}", COMPLETION)
    assert status == 200, body  # through the router: the client's key, forwarded
    assert body["usage"]["completion_tokens"] == 1
    assert call(target.url + "/v1/models", f"bearer {KEY}")[0] == 200  # the scheme: any case
    assert call(target.url + "/metrics", f"Bearer {KEY}")[0] == 401
    assert call(target.url + "/metrics", f"Bearer {ADMIN}")[0] == 200
    assert call(target.url + "/v1/completions", f"Bearer {ADMIN}", COMPLETION)[0] == 401
    if which == "router":
        score = {"prompt": "hi"}
        assert call(target.url + "/kv/score", f"Bearer {KEY}", score)[0] == 401
        assert call(target.url + "/kv/score", f"Bearer {ADMIN}", score)[0] == 200


def test_a_router_with_its_own_key_presents_the_instances_key(
    served: tuple[Serve, RouterProcess, RouterProcess],
) -> None:
    server, _, own_key = served
    status, body, _ = call(own_key.url + "/v1/completions", f"Bearer {ROUTER_KEY}", COMPLETION)
    assert status == 200, body
    assert call(own_key.url + "/v1/completions", f"Bearer {KEY}", COMPLETION)[0] == 401
    # The router's key is no key of the instance's: only the router can use the instance.
    assert call(server.url + "/v1/completions", f"Bearer {ROUTER_KEY}", COMPLETION)[0] == 401
    # Without an admin token, the admin paths take the API key.
    assert call(own_key.url + "/metrics", f"Bearer {ROUTER_KEY}")[0] == 200


def test_keys_come_from_the_flag_then_the_environment_and_none_is_empty(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = {"KVCONNECT_API_KEY": "from-env", "VLLM_API_KEY": "from-vllm"}
    assert secret_from("flag", "--api-key", ("KVCONNECT_API_KEY",), env) == "flag"
    assert secret_from(None, "--api-key", ("KVCONNECT_API_KEY",), env) == "from-env"
    assert secret_from(None, "--api-key", ("X",), env) is None
    with pytest.raises(ValueError, match="KVCONNECT_API_KEY: the key is empty"):
        secret_from(None, "--api-key", ("KVCONNECT_API_KEY",), {"KVCONNECT_API_KEY": " "})
    monkeypatch.delenv("KVCONNECT_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert api_key_from(None, vllm_env=True) == "from-vllm"  # serve, moving from vllm serve
    assert api_key_from(None) is None  # the router: kvconnect's variable only
    with pytest.raises(ValueError, match="--admin-token"):
        BearerAuth("k", admin_token="")


def test_the_policy_per_path() -> None:
    auth = BearerAuth("k", admin_token="t")
    assert auth.allows("/health", None)
    assert auth.allows("/v1/completions", "Bearer k")
    assert not auth.allows("/v1/completions", "Bearer t")
    assert auth.allows("/kv/score", "Bearer t") and auth.allows("/metrics", "Bearer  t ")
    assert not auth.allows("/tokenize", None)
    assert not BearerAuth(None).enabled


def test_several_keys_each_let_a_client_in_and_tell_clients_apart() -> None:
    """`--api-key K1 K2` (vLLM's form): either key is accepted, and each is its own client
    (lease quotas count per client) without the key being kept."""
    auth = BearerAuth(("key-x", "key-y"))
    assert auth.allows("/v1/completions", "Bearer key-x")
    assert auth.allows("/v1/completions", "Bearer key-y")
    assert not auth.allows("/v1/completions", "Bearer key-z")
    assert auth.allows("/metrics", "Bearer key-y")  # no admin token: any API key
    x, y = client_of("Bearer key-x"), client_of("Bearer key-y")
    assert x is not None and y is not None and x != y and "key-x" not in x
    assert client_of(None) is None and client_of("Basic key-x") is None
    assert api_keys_from(["a", "b"]) == ("a", "b")
