"""Bearer-token authentication, the same for `kvconnect serve` and `kvconnect router`.

    no key set          every path is open (as before; bind 127.0.0.1)
    --api-key K [K2..]  every path but /health needs `Authorization: Bearer` with one of the
                        keys (several: one a client, as vLLM takes them; `client_of` tells
                        them apart without keeping the key)
    --admin-token T     /metrics, /kv/score need `Bearer T` (without it: the API key)

Anything else is a 401 in OpenAI's error shape with `WWW-Authenticate: Bearer`. Tokens are
compared with `hmac.compare_digest` over their SHA-256 digests: the time taken says nothing of
how much of a guess was right, not even its length. /health stays open for load balancers and
supervisors (vLLM's is open too); vLLM guards only its /v1 paths, kvconnect guards every other
path, /tokenize and /metrics included, because they reveal the model and the load.

The keys come from the flag, else from the environment (`secret_from`): `KVCONNECT_API_KEY`,
and for serve also vLLM's `VLLM_API_KEY`, so that a deployment moving from `vllm serve` keeps its
secret where it was; `KVCONNECT_ADMIN_TOKEN`, `KVCONNECT_INSTANCE_API_KEY` (the router's key
towards instances). A flag shows in `ps`: the environment is the better place. The environment
is read here only.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping, Sequence

from aiohttp import web
from aiohttp.typedefs import Handler

from kvconnect.api.protocol import ApiError

OPEN_PATHS = frozenset({"/health"})
UNAUTHORIZED = ApiError(
    "a valid API key is required: Authorization: Bearer <key>",
    status=401,
    type_="invalid_request_error",
    code="invalid_api_key",
)
"""What every refused request is answered (a 401, with UNAUTHORIZED_HEADERS), by both servers."""
UNAUTHORIZED_HEADERS = {"WWW-Authenticate": "Bearer"}
ADMIN_PATHS = frozenset({"/metrics", "/kv/score", "/kv/load"})
API_KEY_ENV = "KVCONNECT_API_KEY"
VLLM_API_KEY_ENV = "VLLM_API_KEY"
ADMIN_TOKEN_ENV = "KVCONNECT_ADMIN_TOKEN"
INSTANCE_API_KEY_ENV = "KVCONNECT_INSTANCE_API_KEY"


def secret_from(
    flag: str | None,
    flag_name: str,
    env_names: tuple[str, ...],
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """A key or token: the flag's, else the first of `env_names` set; None when none is. An
    empty one is refused: it would look set and guard nothing."""
    env = os.environ if environ is None else environ
    value, source = flag, flag_name
    for name in env_names:
        if value is None and name in env:
            value, source = env[name], name
    if value is not None and not value.strip():
        raise ValueError(f"{source}: the key is empty")
    return value


def api_key_from(flag: str | None, vllm_env: bool = False) -> str | None:
    """The API key: --api-key, else `KVCONNECT_API_KEY`, else (`vllm_env`) `VLLM_API_KEY`."""
    names = (API_KEY_ENV, VLLM_API_KEY_ENV) if vllm_env else (API_KEY_ENV,)
    return secret_from(flag, "--api-key", names)


def api_keys_from(flags: list[str] | None, vllm_env: bool = False) -> tuple[str, ...] | None:
    """The API keys: every --api-key given (vLLM's `--api-key K1 K2`), else the environment's
    one (`api_key_from`); None when there is none."""
    if not flags:
        key = api_key_from(None, vllm_env)
        return None if key is None else (key,)
    return tuple(api_key_from(flag) or "" for flag in flags)


def client_of(authorization: str | None) -> str | None:
    """Which client presented `authorization` (a short digest of its bearer token, for quotas
    per client), None without one. The key itself is never kept."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return hashlib.sha256(token.strip().encode("utf-8", "surrogatepass")).hexdigest()[:16]


def admin_token_from(flag: str | None) -> str | None:
    return secret_from(flag, "--admin-token", (ADMIN_TOKEN_ENV,))


def instance_api_key_from(flag: str | None) -> str | None:
    return secret_from(flag, "--instance-api-key", (INSTANCE_API_KEY_ENV,))


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class BearerAuth:
    """The tokens a server accepts, per kind of path."""

    def __init__(self, api_key: str | Sequence[str] | None, admin_token: str | None = None) -> None:
        if admin_token is not None and not admin_token.strip():
            raise ValueError("--admin-token: the token is empty")
        keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
        self._api = [_digest(k) for k in keys]
        self._admin = [_digest(admin_token)] if admin_token is not None else self._api

    @property
    def enabled(self) -> bool:
        return bool(self._api or self._admin)

    def expected(self, path: str) -> list[bytes] | None:
        """The digests one of which a request to `path` must present; None when it may come
        without."""
        if path in OPEN_PATHS:
            return None
        return (self._admin if path in ADMIN_PATHS else self._api) or None

    def allows(self, path: str, authorization: str | None) -> bool:
        wanted = self.expected(path)
        if wanted is None:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        # Digest the token even when the scheme is wrong, and compare it with every key:
        # every refusal costs the same.
        digest = _digest(token.strip())
        found = False
        for key in wanted:
            found |= hmac.compare_digest(digest, key)
        return found and scheme.lower() == "bearer"

    def middleware(self) -> web.middleware:  # type: ignore[valid-type]
        @web.middleware
        async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
            if self.allows(request.path, request.headers.get("Authorization")):
                return await handler(request)
            return web.json_response(UNAUTHORIZED.body(), status=401, headers=UNAUTHORIZED_HEADERS)

        return authenticate


__all__ = [
    "ADMIN_PATHS",
    "OPEN_PATHS",
    "UNAUTHORIZED",
    "UNAUTHORIZED_HEADERS",
    "BearerAuth",
    "admin_token_from",
    "api_key_from",
    "api_keys_from",
    "client_of",
    "instance_api_key_from",
    "secret_from",
]
