"""The router's HTTP front: the OpenAI-compatible API of several instances, routing by prefix.

    POST /v1/completions         validated as the engines validate them, tokenized, hashed
    POST /v1/chat/completions    (chats rendered with the model's chat template first, as the
                                 engines render them), scored against the block index,
                                 forwarded unchanged to the chosen instance; its answer,
                                 streamed or not, is passed back with `x-kvconnect-instance`
    GET  /v1/models              from an instance in rotation
    POST /tokenize, /detokenize  the same (vLLM's shapes; every instance has the same model)
    GET  /version                kvconnect's version
    POST /kv/score               {"prompt": ...} or {"messages": [...]}: what each instance
                                 holds of it
    GET  /health                 each instance's state; 503 when none is in rotation
    GET  /metrics                Prometheus: decisions, hits per tier, index, streams, health

Authentication (`api/auth.py`): with `api_key` every path but /health needs the client's
`Authorization: Bearer`; /kv/score and /metrics need `admin_token` when one is set. Towards the
instances the client's Authorization is forwarded unchanged (as llm-d's gateway and
sglang's router do: one key works end to end, and instances with their own `--api-key` check
it again), unless `instance_api_key` is set: then the router presents that key instead (as
vllm-router's `--api-key`), and the instances may have a key of their own, which clients
never see.

Backends are any OpenAI-compatible servers (`kvconnect serve`, `vllm serve`) that publish KV
events. The state (`core.Router`) is started by the caller; the app owns the HTTP client
session and the health checks (`health.py`) for its lifetime. This module never imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass, field

import aiohttp
import msgspec
from aiohttp import web

from kvconnect import __version__
from kvconnect.api.auth import BearerAuth
from kvconnect.api.connections import ConnectionLimits, Listener
from kvconnect.api.http import access_and_errors, error_response, read_body
from kvconnect.api.protocol import (
    MAX_BODY_BYTES,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    parse,
)
from kvconnect.router.core import Router, stale_check
from kvconnect.router.forward import forward
from kvconnect.router.metrics import RouterMetrics
from kvconnect.router.upstream import (
    READ_TIMEOUT_S,
    Unreachable,
    UpstreamBroken,
    UpstreamPool,
    UpstreamTimeout,
)

logger = logging.getLogger(__name__)

SESSION = web.AppKey("session", aiohttp.ClientSession)
POOL = web.AppKey("pool", UpstreamPool)
HEALTH_TASK = web.AppKey("health_task", asyncio.Task[None])
ROUTER = web.AppKey("router", Router)
INLINE_TOKENIZE_BYTES = 16 << 10
"""Bodies up to this size are tokenized on the event loop (ids need no tokenizing at all)."""


@dataclass(frozen=True)
class RouterOptions:
    """The router's HTTP front beyond routing (the flags of `kvconnect router`)."""

    api_key: str | None = field(default=None, repr=False)
    admin_token: str | None = field(default=None, repr=False)
    instance_api_key: str | None = field(default=None, repr=False)
    """Presented to the instances in place of the client's Authorization."""
    upstream_timeout: float = READ_TIMEOUT_S
    """Seconds an instance that took a request may stay silent (`upstream.py`)."""
    limits: ConnectionLimits = field(default_factory=ConnectionLimits)

    def __post_init__(self) -> None:
        key = self.instance_api_key
        if key is not None and (not key.strip() or any(c in key for c in "\r\n")):
            raise ValueError("--instance-api-key: empty, or has a line break in it")
        if not 0 < self.upstream_timeout < float("inf"):
            raise ValueError(f"--upstream-timeout {self.upstream_timeout}: must be positive")


OPTIONS = web.AppKey("options", RouterOptions)


def _none_in_rotation() -> web.Response:
    return error_response(
        ApiError("no instance is in rotation", status=503, type_="service_unavailable")
    )


class RouterServer:
    """The request handlers over one `Router`."""

    def __init__(self, router: Router, options: RouterOptions) -> None:
        self.router = router
        self.metrics = RouterMetrics(router)
        key = options.instance_api_key
        self._instance_auth = f"Bearer {key}" if key is not None else None

    def _authorization(self, http: web.Request) -> str | None:
        """What the instance is shown: the router's own key, else the client's header."""
        return self._instance_auth or http.headers.get("Authorization")

    async def _parse(
        self, http: web.Request, chat: bool | None
    ) -> tuple[bytes, CompletionRequest | ChatCompletionRequest, list[int]]:
        """The body, its request (a chat when `chat`, or when None and it has messages) and
        the prompt tokens the engines will see; `ApiError` when it is not valid."""
        raw = await read_body(http)
        if chat is None:
            try:
                chat = b'"messages"' in raw and "messages" in msgspec.json.decode(raw)
            except (msgspec.DecodeError, TypeError, RecursionError):
                chat = False  # parse() below says what is wrong with it
        req: CompletionRequest | ChatCompletionRequest
        req = parse(raw, ChatCompletionRequest) if chat else parse(raw, CompletionRequest)
        if len(raw) <= INLINE_TOKENIZE_BYTES:
            # Token ids, or text short enough to tokenize in well under a millisecond: a
            # thread hop would cost more than it saves.
            return raw, req, self.router.prompt_tokens(req)
        token_ids = await asyncio.to_thread(self.router.prompt_tokens, req)
        return raw, req, token_ids

    async def route(self, http: web.Request, chat: bool) -> web.StreamResponse:
        try:
            raw, req, token_ids = await self._parse(http, chat)
        except ApiError as e:
            return error_response(e)
        router, pool = self.router, http.app[POOL]
        authorization = self._authorization(http)
        tried: set[str] = set()
        while True:
            picked = router.pick(token_ids, tried, req.cache_salt)
            if picked is None:
                return _none_in_rotation()
            instance, score = picked
            tried.add(instance.name)
            http["instance"] = instance.name
            router.in_flight[instance.name] += 1
            try:
                check = stale_check(req, token_ids)
                return await forward(http, pool, instance, raw, router, score, check, authorization)
            except Unreachable as e:
                logger.warning("router: %s unreachable (%s); trying another", instance.name, e)
                router.mark_down(instance.name, f"forward failed: {e}")
            finally:
                router.in_flight[instance.name] -= 1

    async def completions(self, http: web.Request) -> web.StreamResponse:
        return await self.route(http, chat=False)

    async def chat_completions(self, http: web.Request) -> web.StreamResponse:
        return await self.route(http, chat=True)

    async def models(self, http: web.Request) -> web.Response:
        router = self.router
        authorization = self._authorization(http)
        headers = {"Authorization": authorization} if authorization else None
        for inst in router.instances:
            if not router.health.is_up(inst.name):
                continue
            try:
                url = inst.url + "/v1/models"
                async with http.app[SESSION].get(url, headers=headers) as resp:
                    body = await resp.read()
                    http["instance"] = inst.name
                    return web.Response(
                        body=body, status=resp.status, content_type="application/json"
                    )
            except aiohttp.ClientError as e:
                router.mark_down(inst.name, f"/v1/models failed: {e}")
        return _none_in_rotation()

    async def to_any_instance(self, http: web.Request) -> web.Response:
        """/tokenize and /detokenize: every instance serves the same model, so the first in
        rotation answers (its answer passed back unchanged, as vLLM's or kvconnect's)."""
        router = self.router
        try:
            raw = await read_body(http)
        except ApiError as e:
            return error_response(e)
        for inst in router.instances:
            if not router.health.is_up(inst.name):
                continue
            try:
                upstream = await http.app[POOL].post(
                    inst.url, http.path, raw, authorization=self._authorization(http)
                )
            except (Unreachable, UpstreamTimeout) as e:
                router.mark_down(inst.name, f"{http.path} failed: {e}")
                continue
            try:
                body = await upstream.read()
            except UpstreamBroken as e:
                logger.warning("router: %s failed mid-answer: %s", inst.name, e)
                if isinstance(e, UpstreamTimeout):
                    router.mark_down(inst.name, f"{http.path} stalled: {e}")
                continue
            finally:
                upstream.release()
            http["instance"] = inst.name
            content_type = upstream.headers.get("content-type", "application/json")
            headers = {"Content-Type": content_type, "x-kvconnect-instance": inst.name}
            return web.Response(body=body, status=upstream.status, headers=headers)
        return _none_in_rotation()

    async def version(self, _: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    async def kv_score(self, http: web.Request) -> web.Response:
        """What each instance holds of a prompt or a chat's messages, as the router sees it
        (nothing is sent)."""
        try:
            _, req, token_ids = await self._parse(http, None)
        except ApiError as e:
            return error_response(e)
        scores = self.router.scores(token_ids, req.cache_salt)
        instances = {
            name: {
                "cached_blocks": sc.num_blocks,
                "cached_tokens": sc.num_tokens,
                "block_size": sc.block_size,
                "blocks_per_tier": sc.blocks_per_tier,
            }
            for name, sc in scores.items()
        }
        return web.json_response({"prompt_tokens": len(token_ids), "instances": instances})

    async def health(self, _: web.Request) -> web.Response:
        states = self.router.health.states
        instances = {
            name: {"state": "up" if s.up else "down", "reason": s.reason}
            for name, s in states.items()
        }
        up = sum(s.up for s in states.values())
        status = "ok" if up == len(instances) else "degraded" if up else "error"
        return web.json_response(
            {"status": status, "instances": instances}, status=200 if up else 503
        )

    async def prometheus(self, _: web.Request) -> web.Response:
        text = await asyncio.to_thread(self.metrics.render)
        return web.Response(body=text, content_type="text/plain", charset="utf-8")


async def _open(app: web.Application) -> None:
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
    app[SESSION] = session  # health checks and /v1/models
    app[POOL] = UpstreamPool(read_timeout=app[OPTIONS].upstream_timeout)  # the completions
    app[HEALTH_TASK] = asyncio.create_task(app[ROUTER].health.run(session))


async def _close(app: web.Application) -> None:
    app[HEALTH_TASK].cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await app[HEALTH_TASK]
    await app[SESSION].close()
    await app[POOL].close()
    await asyncio.to_thread(app[ROUTER].close)


def make_app(router: Router, options: RouterOptions | None = None) -> web.Application:
    """The router's aiohttp app; on cleanup it closes `router` too."""
    options = options or RouterOptions()
    handlers = RouterServer(router, options)
    auth = BearerAuth(options.api_key, options.admin_token)
    middlewares = [access_and_errors, auth.middleware()] if auth.enabled else [access_and_errors]
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES + 1)
    app[ROUTER] = router
    app[OPTIONS] = options
    app.on_startup.append(_open)
    app.on_cleanup.append(_close)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_post("/tokenize", handlers.to_any_instance)
    app.router.add_post("/detokenize", handlers.to_any_instance)
    app.router.add_get("/version", handlers.version)
    app.router.add_post("/kv/score", handlers.kv_score)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/metrics", handlers.prometheus)
    return app


async def serve_router(
    router: Router, host: str, port: int, options: RouterOptions | None = None
) -> int:
    """Serve `router` on host:port until SIGINT or SIGTERM; 0."""
    options = options or RouterOptions()
    listener = Listener(make_app(router, options), options.limits)
    stop = asyncio.Event()
    try:
        await listener.start(host, port)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        listing = "; ".join(
            f"{i.url} (events {i.events_endpoint}, replay {i.replay_endpoint or 'none'})"
            for i in router.instances
        )
        print(f"kvconnect router: ready at http://{host}:{port}; instances: {listing}", flush=True)
        await stop.wait()
    finally:
        await listener.close()
    return 0
