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
                                 holds of it, and the choice routing it now would make
                                 (`choice`: instance, pull source, each instance's cost)
    GET  /kv/load                this replica's own requests in flight per instance and their
                                 prompt tokens to compute, for its replicas (replicas.py)
    GET  /health                 each instance's state (and whether its stream's state is in
                                 the index yet); 503 when none is in rotation
    GET  /metrics                Prometheus: decisions, hits per tier, index, streams, health

Authentication (`http/auth.py`): with `api_key` every path but /health needs the client's
`Authorization: Bearer`; /kv/score, /kv/load and /metrics need `admin_token` when one is set
(replicas read each other's /kv/load with it, or with `api_key`). Towards the
instances the client's Authorization is forwarded unchanged (as llm-d's gateway and
sglang's router do: one key works end to end, and instances with their own `--api-key` check
it again), unless `instance_api_key` is set: then the router presents that key instead (as
vllm-router's `--api-key`), and the instances may have a key of their own, which clients
never see.

Backends are any OpenAI-compatible servers (`kvconnect serve`, `vllm serve`) that publish KV
events. The state (`core.Router`) is started by the caller; `RouterFront` serves the routes
through `http/h1_server.py`'s server (aiohttp's cost the relay a third of its CPU: that module
says why) and owns the upstream pool (`http/client.py`: the relays, /v1/models, the health
checks) and the checks themselves (`health.py`) for its lifetime. This module never
imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import msgspec

from kvconnect import __version__
from kvconnect.api.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    parse,
)
from kvconnect.http.auth import BearerAuth
from kvconnect.http.client import (
    READ_TIMEOUT_S,
    Unreachable,
    UpstreamBroken,
    UpstreamPool,
    UpstreamTimeout,
)
from kvconnect.http.h1_server import (
    H1Server,
    Handler,
    Request,
    Response,
    error_response,
    json_response,
)
from kvconnect.http.limits import ConnectionLimits
from kvconnect.router.core import Picked, Router, Scored, stale_check
from kvconnect.router.forward import Relay, forward
from kvconnect.router.loads import Loads
from kvconnect.router.metrics import RouterMetrics
from kvconnect.router.pd import Body, PrefillStep
from kvconnect.router.replicas import LOAD_HOLD_S, load_after
from kvconnect.router.tracing import RouterTracing, RouteTrace, passthrough

logger = logging.getLogger(__name__)

INLINE_TOKENIZE_BYTES = 16 << 10
"""Bodies up to this size are tokenized on the event loop (ids need no tokenizing at all)."""


@dataclass(frozen=True)
class RouterOptions:
    """The router's HTTP front beyond routing (the flags of `kvconnect router`)."""

    api_key: str | tuple[str, ...] | None = field(default=None, repr=False)
    admin_token: str | None = field(default=None, repr=False)
    instance_api_key: str | None = field(default=None, repr=False)
    """Presented to the instances in place of the client's Authorization."""
    upstream_timeout: float = READ_TIMEOUT_S
    """Seconds an instance that took a request may stay silent (`http/client.py`)."""
    limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    allow_unauthenticated: bool = False
    """Present `instance_api_key` even to clients that no `api_key` checks (an open relay)."""
    pd_min_tail: int = 256
    """P/D: disaggregate only when the decode instance lacks at least this many of the
    prompt's tokens, until the pair's crossover is measured (router/pd.py)."""
    trust_client_kv_params: bool = False
    """Relay a client's own `kv_transfer_params` (the client is a proxy); else they are
    dropped: a client must not make an instance pull from or lease to whom it says, nor read
    a prefill's peer address and lease in its answer."""
    tracing: RouterTracing | None = None
    """A span per routed request (`--otlp-traces-endpoint`, router/tracing.py); None: off."""

    def __post_init__(self) -> None:
        key = self.instance_api_key
        if key is not None and (not key.strip() or any(c in key for c in "\r\n")):
            raise ValueError("--instance-api-key: empty, or has a line break in it")
        self._check_not_an_open_relay()
        if not 0 < self.upstream_timeout < float("inf"):
            raise ValueError(f"--upstream-timeout {self.upstream_timeout}: must be positive")

    def _check_not_an_open_relay(self) -> None:
        """The instances' key lent to anyone: a client the instances would answer 401 gets
        through the router with their key. Only on purpose (`--allow-unauthenticated`)."""
        open_relay = self.instance_api_key is not None and self.api_key is None
        if open_relay and not self.allow_unauthenticated:
            raise ValueError(
                "--instance-api-key without --api-key: any client could use the instances' "
                "key through the router; set --api-key (or $KVCONNECT_API_KEY), or pass "
                "--allow-unauthenticated to run an open relay on purpose"
            )


def _none_in_rotation() -> Response:
    return error_response(
        ApiError("no instance is in rotation", status=503, type_="service_unavailable")
    )


def _none_answered(reason: str) -> Response:
    """Every instance tried failed before answering; the last one's reason."""
    return error_response(
        ApiError(f"no instance answered (last, {reason})", status=502, type_="bad_gateway")
    )


def _counted(
    release: Callable[[], None] | None,
    loads: Loads,
    name: str,
    computed: int,
    ended: Callable[[], None] | None = None,
) -> Callable[[], None]:
    """`release` (if any), then the instance's request, and the `computed` tokens it was
    expected to compute there, no longer in flight (and `ended`)."""

    def done() -> None:
        if release is not None:
            release()
        loads.landed(name, computed)
        if ended is not None:
            ended()

    return done


@dataclass
class _Routing:
    """One client request as it is routed, over the instances tried."""

    http: Request
    req: CompletionRequest | ChatCompletionRequest
    token_ids: list[int]
    body: Body
    own_params: bool
    """A trusted client's own `kv_transfer_params` stay (and win over a pull's)."""
    authorization: str | None
    trace: RouteTrace | None
    prefill_pending: bool
    """P/D: the prefill step runs once, whichever decode instance answers."""
    with_params: tuple[bytes, str] | None = None
    """P/D: the body with P's params, and P."""


class RouterServer:
    """The request handlers over one `Router`; `start()` starts the health checks, `close()`
    stops them and closes the upstream pool and the router."""

    def __init__(self, router: Router, options: RouterOptions) -> None:
        self.router = router
        key = options.instance_api_key
        self._instance_auth = f"Bearer {key}" if key is not None else None
        self.pool = UpstreamPool(read_timeout=options.upstream_timeout)
        self.pd = PrefillStep(router, self.pool, options.pd_min_tail)
        self.metrics = RouterMetrics(router, self.pd.outcomes)
        self.trust_client_kv_params = options.trust_client_kv_params
        self.tracing = options.tracing
        keys = (options.api_key,) if isinstance(options.api_key, str) else options.api_key or ()
        token = options.admin_token or next(iter(keys), None)
        self._replica_auth = f"Bearer {token}" if token is not None else None
        self._health: asyncio.Task[None] | None = None
        self._replicas: asyncio.Task[None] | None = None
        self._load_event = asyncio.Event()
        self._load_waiting = 0  # held /kv/load reads
        router.loads.watch(self._wake_load_waiters)

    async def start(self) -> None:
        self._health = asyncio.create_task(self.router.health.run(self.pool))
        replicas = self.router.loads.replicas
        if replicas is not None:
            self._replicas = asyncio.create_task(replicas.follow(self.pool, self._replica_auth))

    async def close(self) -> None:
        for task in (self._health, self._replicas):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.pool.close()
        await asyncio.to_thread(self.router.close)

    def routes(self) -> dict[str, dict[str, Handler]]:
        return {
            "/v1/completions": {"POST": self.completions},
            "/v1/chat/completions": {"POST": self.chat_completions},
            "/v1/models": {"GET": self.to_any_instance},
            "/tokenize": {"POST": self.to_any_instance},
            "/detokenize": {"POST": self.to_any_instance},
            "/version": {"GET": self.version},
            "/kv/score": {"POST": self.kv_score},
            "/kv/load": {"GET": self.kv_load},
            "/health": {"GET": self.health},
            "/metrics": {"GET": self.prometheus},
        }

    def _authorization(self, http: Request) -> str | None:
        """What the instance is shown: the router's own key, else the client's header."""
        return self._instance_auth or http.headers.get("authorization")

    async def _parse(
        self, http: Request, chat: bool | None
    ) -> tuple[CompletionRequest | ChatCompletionRequest, list[int]]:
        """The body's request (a chat when `chat`, or when None and it has messages) and the
        prompt tokens the engines will see; `ApiError` when it is not valid."""
        raw = http.body
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
            return req, self.router.prompt_tokens(req)
        token_ids = await asyncio.to_thread(self.router.prompt_tokens, req)
        return req, token_ids

    async def route(self, http: Request, chat: bool) -> Response:
        if self.tracing is None:
            return await self._route(http, chat, None)
        return await self.tracing.traced(http, partial(self._route, http, chat))

    async def _route(self, http: Request, chat: bool, trace: RouteTrace | None) -> Response:
        req, token_ids = await self._parse(http, chat)
        router = self.router
        body = Body(http.body)  # what the instance gets, but for the params added
        own_params = req.kv_transfer_params is not None and self.trust_client_kv_params
        if req.kv_transfer_params is not None and not own_params:
            body.drop_params()
        pd = bool(router.instances.prefill_names)
        r = _Routing(http, req, token_ids, body, own_params, self._authorization(http), trace, pd)
        await router.follow.wait_synced()  # a router just (re)started: the whole index
        if not pd:  # a burst sharing a new prefix: computed once, not everywhere
            await router.bursts.wait_for_prefill(token_ids, req.cache_salt)
        tried: set[str] = set()
        failed = ""
        while True:
            costs: dict[str, float] | None = None if trace is None else {}
            scored = router.scored(token_ids, req.cache_salt)
            picked = router.pick(scored, tried, costs)
            if picked is None:
                return _none_answered(failed) if failed else _none_in_rotation()
            name = picked.instance.name
            tried.add(name)
            http.instance = name
            try:
                return await self._send(r, scored, picked, costs)
            except Unreachable as e:
                logger.warning("router: %s unreachable (%s); trying another", name, e)
                if trace is not None:
                    trace.unreachable(name, e)
                router.mark_down(name, f"forward failed: {e}")
                failed = f"{name}: {e}"

    async def _send(
        self, r: _Routing, scored: Scored, picked: Picked, costs: dict[str, float] | None
    ) -> Response:
        """The request to `picked`, in flight there until its answer is sent, cut or
        abandoned (a stream's takes a while); `Unreachable` before the answer begins."""
        router, name, computed = self.router, picked.instance.name, picked.computed
        others, ahead = router.loads.of([name])  # before this one: what it meets
        router.loads.sent(name, computed)
        computing = None
        if picked.source is None and not router.instances.prefill_names:
            computing = router.bursts.prefilling(name, r.token_ids, r.req.cache_salt, picked.score)
        ended = None if computing is None else partial(router.bursts.prefilled, computing)
        try:
            relay = await self._relay(r, scored, picked, (others[name], ahead[name]), costs)
            response = await forward(r.http, self.pool, router, relay)
        except BaseException:
            router.loads.landed(name, computed)
            if ended is not None:
                ended()
            raise
        response.on_close = _counted(response.on_close, router.loads, name, computed, ended)
        return response

    async def _relay(
        self,
        r: _Routing,
        scored: Scored,
        picked: Picked,
        load: tuple[int, int],
        costs: dict[str, float] | None,
    ) -> Relay:
        """What `picked` gets: with P's params (P/D), or a pull's source, or as it came. P
        and D get the same trace context (the router's span, or the client's traceparent)."""
        headers = passthrough(r.http.headers) if r.trace is None else r.trace.headers()
        if r.prefill_pending:
            r.prefill_pending = False
            r.with_params = await self.pd.run(
                r.http.path, r.body, scored, picked, r.authorization, headers
            )
        body, pulls_from = r.with_params or (None, None)
        if body is None and picked.source is not None and not r.own_params:
            body = r.body.with_source(picked.source)  # a trusted client's own params win
            pulls_from = picked.source.name
        # D counts what it pulled (or, vLLM, P's hits), not what its index entry says; an
        # instance that pulled, what it pulled too
        check = None if pulls_from else stale_check(r.req, r.token_ids)
        if r.trace is not None and costs is not None:
            r.trace.decided(picked, len(r.token_ids), costs, pulls_from)
        streamed_usage = r.req.stream and r.req.include_usage
        return Relay(
            picked.instance,
            body or r.body.raw,
            picked.score,
            pulls_from,
            check,
            load,
            streamed_usage,
            r.authorization,
            headers,
        )

    async def completions(self, http: Request) -> Response:
        return await self.route(http, chat=False)

    async def chat_completions(self, http: Request) -> Response:
        return await self.route(http, chat=True)

    async def to_any_instance(self, http: Request) -> Response:
        """/v1/models, /tokenize and /detokenize: every instance serves the same model, so
        the first in rotation answers (its answer passed back unchanged)."""
        router = self.router
        authorization = self._authorization(http)
        for inst in router.instances:
            if not router.health.is_up(inst.name):
                continue
            try:
                if http.method == "POST":
                    upstream = await self.pool.post(
                        inst.url, http.path, http.body, authorization=authorization
                    )
                else:
                    upstream = await self.pool.get(inst.url, http.path, authorization)
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
            http.instance = inst.name
            content_type = upstream.headers.get("content-type", "application/json")
            headers = {"x-kvconnect-instance": inst.name}
            return Response(upstream.status, body, content_type, headers)
        return _none_in_rotation()

    async def version(self, _: Request) -> Response:
        return json_response({"version": __version__})

    async def kv_score(self, http: Request) -> Response:
        """What each instance holds of a prompt or a chat's messages, as the router sees it
        (nothing is sent)."""
        req, token_ids = await self._parse(http, None)
        router = self.router
        scored = router.scored(token_ids, req.cache_salt)
        costs: dict[str, float] = {}
        pd = bool(router.instances.prefill_names)
        picked = None if pd else router.pick(scored, set(), costs)
        instances = {
            name: {
                "cached_blocks": sc.num_blocks,
                "cached_tokens": sc.num_tokens,
                "block_size": sc.block_size,
                "blocks_per_tier": sc.blocks_per_tier,
            }
            for name, sc in scored.scores.items()
        }
        choice = None
        if picked is not None:  # what routing it now would choose (in prompt tokens' worth)
            source = picked.source.name if picked.source is not None else None
            choice = {"instance": picked.instance.name, "source": source, "costs": costs}
        answer = {"prompt_tokens": len(token_ids), "instances": instances, "choice": choice}
        return json_response(answer)

    async def kv_load(self, http: Request) -> Response:
        """This replica's own load per instance and its version; with `?after=V`, answered
        once the version is past V, or after LOAD_HOLD_S (replicas.py)."""
        loads = self.router.loads
        try:
            after = load_after(http.query)
        except ValueError as e:
            return error_response(ApiError(str(e), param="after"))
        if after is not None and loads.version <= after:
            self._load_waiting += 1
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._load_event.wait(), LOAD_HOLD_S)
            finally:
                self._load_waiting -= 1
        return json_response(loads.state(after))

    def _wake_load_waiters(self) -> None:
        """The router's own load changed: every held /kv/load answers now (twice a request:
        nothing to do without replicas reading)."""
        if self._load_waiting:
            self._load_event.set()
            self._load_event = asyncio.Event()

    async def health(self, _: Request) -> Response:
        states, synced = self.router.health.states, self.router.follow.synced
        instances = {
            name: {"state": "up" if s.up else "down", "reason": s.reason, "synced": name in synced}
            for name, s in states.items()
        }
        up = sum(s.up for s in states.values())
        status = "ok" if up == len(instances) else "degraded" if up else "error"
        return json_response({"status": status, "instances": instances}, 200 if up else 503)

    async def prometheus(self, _: Request) -> Response:
        text = await asyncio.to_thread(self.metrics.render)
        return Response(200, text, "text/plain; charset=utf-8")


class RouterFront:
    """`Router`'s HTTP front on host:port: the handlers, their server, their lifetime."""

    def __init__(self, router: Router, options: RouterOptions | None = None) -> None:
        options = options or RouterOptions()
        self.handlers = RouterServer(router, options)
        auth = BearerAuth(options.api_key, options.admin_token)
        self.server = H1Server(self.handlers.routes(), options.limits, auth)

    async def start(self, host: str, port: int) -> None:
        await self.handlers.start()
        await self.server.start(host, port)

    async def close(self) -> None:
        """Stop listening and close every connection, then the pool, the checks, the router."""
        await self.server.close()
        await self.handlers.close()


async def serve_router(
    router: Router, host: str, port: int, options: RouterOptions | None = None
) -> int:
    """Serve `router` on host:port until SIGINT or SIGTERM; 0."""
    front = RouterFront(router, options)
    stop = asyncio.Event()
    try:
        await front.start(host, port)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        listing = "; ".join(
            f"{i.url} (events {i.events_endpoint}, replay {i.replay_endpoint or 'none'})"
            for i in router.instances
        )
        print(f"kvconnect router: ready at http://{host}:{port}; instances: {listing}", flush=True)
        # What start-up made (tokenizer, template, modules) stays: out of the collector's
        # sight, a full collection no longer walks it in the middle of a request (as vLLM).
        gc.freeze()
        await stop.wait()
    finally:
        await front.close()
    return 0
