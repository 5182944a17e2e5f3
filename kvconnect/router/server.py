"""`kvconnect router`: the OpenAI-compatible front of several instances, routing by prefix.

    POST /v1/completions         validated as the engines validate them, tokenized, hashed
    POST /v1/chat/completions    (chats rendered with the model's chat template first, as the
                                 engines render them), scored against the block index,
                                 forwarded unchanged to the chosen instance; its answer,
                                 streamed or not, is passed back with `x-kvconnect-instance`
    GET  /v1/models              from an instance in rotation
    POST /kv/score               {"prompt": ...} or {"messages": [...]}: what each instance
                                 holds of it
    GET  /health                 each instance's state; 503 when none is in rotation
    GET  /metrics                Prometheus: decisions, hits per tier, index, streams, health

Backends are any OpenAI-compatible servers (`kvconnect serve`, `vllm serve`) that publish KV
events. A subscriber thread follows every instance's event stream (with replay) into the
`BlockIndex` under a lock; the handlers score under the same lock. Active health checks
(`health.py`) keep dead or broken instances out of rotation. This module never imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvconnect.api.http import access_and_errors, error_response, read_body
from kvconnect.api.protocol import (
    MAX_BODY_BYTES,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    parse,
)
from kvconnect.router.health import HealthChecker
from kvconnect.router.index import BlockIndex, PrefixScore
from kvconnect.router.scorer import DEFAULT_LOAD_WEIGHT, choose, spread_key
from kvconnect.subscriber import KVEventSubscriber, ReceivedBatch, StreamSnapshot
from kvconnect.tokenizer import ChatTemplateError, Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Instance:
    """One engine instance behind the router. Its URL is its name everywhere: in the index,
    the scorer, metrics and logs."""

    url: str
    events_endpoint: str
    replay_endpoint: str | None = None

    @property
    def name(self) -> str:
        return self.url

    @classmethod
    def parse(cls, spec: str) -> Instance:
        """`URL,EVENTS_ENDPOINT[,REPLAY_ENDPOINT]`."""
        parts = spec.split(",")
        if (
            len(parts) not in (2, 3)
            or not parts[0].startswith(("http://", "https://"))
            or not all(p.startswith(("tcp://", "ipc://", "inproc://")) for p in parts[1:])
        ):
            raise ValueError(
                f"--instance {spec!r}: expected URL,EVENTS_ENDPOINT[,REPLAY_ENDPOINT] "
                "(e.g. http://127.0.0.1:8001,tcp://127.0.0.1:18001,tcp://127.0.0.1:28001)"
            )
        return cls(parts[0].rstrip("/"), parts[1], parts[2] if len(parts) == 3 else None)


class Router:
    def __init__(
        self,
        instances: list[Instance],
        index: BlockIndex,
        tokenizer: Tokenizer,
        load_weight: float = DEFAULT_LOAD_WEIGHT,
    ) -> None:
        if not instances:
            raise ValueError("the router needs at least one --instance")
        self.instances = instances
        self.index = index
        self.tokenizer = tokenizer
        self.load_weight = load_weight
        self.lock = threading.Lock()
        self.in_flight: Counter[str] = Counter()
        self.decisions: Counter[str] = Counter()
        self.hit_blocks: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self._by_name = {i.name: i for i in instances}
        if len(self._by_name) != len(instances):
            raise ValueError("each --instance must have its own URL")
        self.health = HealthChecker([i.name for i in instances])
        for inst in instances:
            index.add_instance(inst.name)
        # The subscriber names a stream by the endpoint it reads; that maps to one instance.
        self._name_by_endpoint = {i.events_endpoint: i.name for i in instances}
        self.last_seq: dict[str, int] = {}
        """Per instance, the seq of the last batch (or snapshot) its index state includes."""
        self.subscriber = KVEventSubscriber(
            [i.events_endpoint for i in instances],
            [i.replay_endpoint for i in instances],
            start_seq=0,
            snapshots=True,  # a router that (re)starts, or loses batches, gets the whole state
        )
        self._thread = threading.Thread(target=self._follow, name="router-events", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        for item in self.subscriber:
            name = self._name_by_endpoint[item.stream.endpoint]
            with self.lock:
                self.index.apply_item(name, item)
                if isinstance(item, ReceivedBatch | StreamSnapshot):
                    self.last_seq[name] = item.seq

    def scores(self, token_ids: list[int], cache_salt: str | None = None) -> dict[str, PrefixScore]:
        """Per instance name, what it holds of the request's prefix."""
        with self.lock:
            return self.index.score(token_ids, cache_salt)

    def pick(
        self, token_ids: list[int], exclude: set[str], cache_salt: str | None = None
    ) -> tuple[Instance, PrefixScore] | None:
        """The instance in rotation (and not in `exclude`) to send the request to."""
        names = [
            i.name for i in self.instances if i.name not in exclude and self.health.is_up(i.name)
        ]
        if not names:
            return None
        with self.lock:  # one state for both
            scores = self.index.score(token_ids, cache_salt)
            num_blocks = self.index.num_blocks()
        decision = choose(
            names,
            scores,
            {n: self.in_flight[n] for n in names},
            len(token_ids),
            self.load_weight,
            spread_key(token_ids),
            num_blocks,
        )
        return self._by_name[decision.instance], decision.score

    def mark_down(self, name: str, reason: str) -> None:
        self.health.mark(name, False, reason)
        self.failures[name] += 1

    def close(self) -> None:
        self.subscriber.close()
        self._thread.join(timeout=2)

    def prompt_tokens(self, req: CompletionRequest | ChatCompletionRequest) -> list[int]:
        """The tokens the engines will see first: a chat rendered with the chat template, or
        the first prompt (a multi-prompt request goes where its first prompt is cached)."""
        if isinstance(req, ChatCompletionRequest):
            try:
                text = self.tokenizer.apply_chat_template(
                    req.conversation(), req.add_generation_prompt
                )
            except ChatTemplateError as e:
                raise ApiError(str(e), "messages") from None
            return self.tokenizer.encode(text)
        first = req.prompts()[0]
        return first if isinstance(first, list) else self.tokenizer.encode(first)


class RouterMetrics(Collector):
    """The router's state as Prometheus metrics, read at scrape time."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        r = self.router
        with r.lock:
            stats = r.index.stats
            num_entries = r.index.num_entries
            schemes = r.index.schemes()
            stale = sum(i.stale for i in r.index.instances.values())
            removed_per_tier, stale_per_tier = dict(stats.removed), dict(stats.stale)

        def counter(name: str, doc: str, value: float) -> Metric:
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            return c

        def gauge(name: str, doc: str, value: float) -> Metric:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            return g

        def per(
            name: str, doc: str, label: str, values: Mapping[str, float], kind: type[Any]
        ) -> Metric:
            m: Metric = kind(name, doc, labels=[label])
            for key, value in sorted(values.items()):
                m.add_metric([key], value)  # type: ignore[attr-defined]
            return m

        yield gauge("kvconnect_router_index_entries", "Block keys in the index.", num_entries)
        for name, doc, value in (
            ("events_applied", "KV events applied.", stats.events_applied),
            ("batches_applied", "KV event batches applied.", stats.batches_applied),
            ("instance_clears", "Times an instance's entries were dropped.", stats.clears),
            ("publisher_restarts", "Publisher restarts seen.", stats.restarts),
            ("event_gaps_lost", "Event gaps replay could not repair.", stats.gaps_lost),
            (
                "snapshots",
                "Instance snapshots applied (at first contact, after a loss).",
                stats.snapshots,
            ),
            ("index_evictions", "Entries evicted by the index's cap.", stats.entries_evicted),
            ("hash_mismatches", "Events contradicting their own token ids.", stats.hash_mismatches),
            ("gaps_repaired", "Sequence gaps filled from replay.", r.subscriber.num_gaps_repaired),
            ("batches_lost", "Batches replay no longer held.", r.subscriber.num_batches_lost),
        ):
            yield counter(f"kvconnect_router_{name}", doc, value)
        yield gauge("kvconnect_router_stale_instances", "Instances awaiting a resync.", stale)
        names = [i.name for i in r.instances]
        C, G = CounterMetricFamily, GaugeMetricFamily
        for metric, doc, label, values, kind in (
            ("decisions", "Requests sent to each instance.", "instance",
             {n: r.decisions[n] for n in names}, C),
            ("forward_failures", "Forwards refused by each instance.", "instance",
             {n: r.failures[n] for n in names}, C),
            ("in_flight", "Requests in flight per instance.", "instance",
             {n: r.in_flight[n] for n in names}, G),
            ("instance_up", "1 while an instance is in rotation.", "instance",
             {n: float(r.health.is_up(n)) for n in names}, G),
            ("hit_blocks", "Cached prefix blocks of routed requests, by tier.", "tier",
             dict(r.hit_blocks), C),
            ("index_removed", "Index entries taken back by BlockRemoved events, by tier.",
             "tier", removed_per_tier, C),
            ("index_stale", "Index entries found stale by a load miss (an instance computed "
             "fewer cached tokens than the index credited it), by tier.", "tier",
             stale_per_tier, C),
        ):  # fmt: skip
            yield per(f"kvconnect_router_{metric}", doc, label, values, kind)
        info = GaugeMetricFamily(
            "kvconnect_router_instance_hash_scheme",
            "The hash scheme learned from each instance's stream (1 per instance).",
            labels=["instance", "scheme", "block_size"],
        )
        for name, (scheme, block_size) in sorted(schemes.items()):
            info.add_metric([name, scheme, str(block_size or 0)], 1)
        yield info


def make_app(router: Router) -> web.Application:
    state: dict[str, Any] = {}
    metrics = RouterMetrics(router)

    async def on_startup(_: web.Application) -> None:
        state["session"] = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5)
        )
        state["health"] = asyncio.create_task(router.health.run(state["session"]))

    async def on_cleanup(_: web.Application) -> None:
        state["health"].cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await state["health"]
        await state["session"].close()
        await asyncio.to_thread(router.close)

    async def route(http: web.Request, chat: bool) -> web.StreamResponse:
        req: CompletionRequest | ChatCompletionRequest
        try:
            raw = await read_body(http)
            req = parse(raw, ChatCompletionRequest) if chat else parse(raw, CompletionRequest)
            token_ids = await asyncio.to_thread(router.prompt_tokens, req)
        except ApiError as e:
            return error_response(e)
        tried: set[str] = set()
        while True:
            picked = router.pick(token_ids, tried, req.cache_salt)
            if picked is None:
                return error_response(
                    ApiError("no instance is in rotation", status=503, type_="service_unavailable")
                )
            instance, score = picked
            tried.add(instance.name)
            http["instance"] = instance.name
            router.in_flight[instance.name] += 1
            try:
                return await _forward(
                    http,
                    state["session"],
                    instance,
                    raw,
                    router,
                    score,
                    stale_check(req, token_ids),
                )
            except _Unreachable as e:
                logger.warning("router: %s unreachable (%s); trying another", instance.name, e)
                router.mark_down(instance.name, f"forward failed: {e}")
            finally:
                router.in_flight[instance.name] -= 1

    async def completions(http: web.Request) -> web.StreamResponse:
        return await route(http, chat=False)

    async def chat_completions(http: web.Request) -> web.StreamResponse:
        return await route(http, chat=True)

    async def models(http: web.Request) -> web.Response:
        for inst in router.instances:
            if not router.health.is_up(inst.name):
                continue
            try:
                async with state["session"].get(inst.url + "/v1/models") as resp:
                    body = await resp.read()
                    http["instance"] = inst.name
                    return web.Response(
                        body=body, status=resp.status, content_type="application/json"
                    )
            except aiohttp.ClientError as e:
                router.mark_down(inst.name, f"/v1/models failed: {e}")
        return error_response(
            ApiError("no instance is in rotation", status=503, type_="service_unavailable")
        )

    async def kv_score(http: web.Request) -> web.Response:
        """What each instance holds of a prompt or a chat's messages, as the router sees it
        (nothing is sent)."""
        req: CompletionRequest | ChatCompletionRequest
        try:
            raw = await read_body(http)
            try:
                chat = b'"messages"' in raw and "messages" in msgspec.json.decode(raw)
            except (msgspec.DecodeError, TypeError, RecursionError):
                chat = False  # parse() below says what is wrong with it
            req = parse(raw, ChatCompletionRequest) if chat else parse(raw, CompletionRequest)
            token_ids = await asyncio.to_thread(router.prompt_tokens, req)
        except ApiError as e:
            return error_response(e)
        scores = router.scores(token_ids, req.cache_salt)
        return web.json_response(
            {
                "prompt_tokens": len(token_ids),
                "instances": {
                    name: {
                        "cached_blocks": sc.num_blocks,
                        "cached_tokens": sc.num_tokens,
                        "block_size": sc.block_size,
                        "blocks_per_tier": sc.blocks_per_tier,
                    }
                    for name, sc in scores.items()
                },
            }
        )

    async def health(_: web.Request) -> web.Response:
        instances = {
            name: {"state": "up" if s.up else "down", "reason": s.reason}
            for name, s in router.health.states.items()
        }
        up = sum(s.up for s in router.health.states.values())
        status = "ok" if up == len(instances) else "degraded" if up else "error"
        return web.json_response(
            {"status": status, "instances": instances}, status=200 if up else 503
        )

    async def prometheus(_: web.Request) -> web.Response:
        text = await asyncio.to_thread(metrics.render)
        return web.Response(body=text, content_type="text/plain", charset="utf-8")

    app = web.Application(middlewares=[access_and_errors], client_max_size=MAX_BODY_BYTES + 1)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/kv/score", kv_score)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", prometheus)
    return app


StaleCheck = tuple[list[int], str | None]
"""(prompt token ids, cache salt): what to check an answer's cached tokens against."""
MAX_CHECKED_BODY = 1 << 20


def stale_check(
    req: CompletionRequest | ChatCompletionRequest, token_ids: list[int]
) -> StaleCheck | None:
    """A request whose usage speaks of one prompt (chat, or a single completion prompt)."""
    if isinstance(req, CompletionRequest) and len(req.prompts()) != 1:
        return None
    return token_ids, req.cache_salt


def check_cached(
    router: Router, name: str, score: PrefixScore, check: StaleCheck, body: bytes
) -> None:
    """The instance's own count of cached prompt tokens against what the index credited it:
    fewer means the index holds entries the instance no longer has (`BlockIndex.mark_stale`)."""
    try:
        usage = json.loads(body).get("usage") or {}
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    except (ValueError, TypeError, AttributeError):
        return
    if cached < score.num_tokens:
        with router.lock:
            dropped = router.index.mark_stale(name, check[0], cached, check[1])
        if dropped:
            logger.info(
                "router: %s computed %d cached prompt tokens where the index said %d; "
                "dropped %d stale entries",
                name,
                cached,
                score.num_tokens,
                dropped,
            )


class _Unreachable(Exception):
    """The instance failed before answering: the request may go to another one."""


async def _post(session: aiohttp.ClientSession, url: str, raw: bytes) -> aiohttp.ClientResponse:
    """The upstream response (headers read). A refused or timed-out connect is `_Unreachable`
    at once; a failure on a pooled keep-alive connection (the instance closed it as it was
    reused) is retried, up to twice, before it is."""
    for attempt in range(3):
        try:
            return await session.post(url, data=raw, headers={"Content-Type": "application/json"})
        except (aiohttp.ClientConnectorError, TimeoutError) as e:
            raise _Unreachable(str(e) or type(e).__name__) from None
        except aiohttp.ClientConnectionError as e:
            if attempt == 2:
                raise _Unreachable(str(e) or type(e).__name__) from None
            logger.debug("router: %s: %s on a pooled connection; retrying", url, e)
    raise AssertionError("unreachable")


async def _forward(
    http: web.Request,
    session: aiohttp.ClientSession,
    instance: Instance,
    raw: bytes,
    router: Router,
    score: PrefixScore,
    check: StaleCheck | None = None,
) -> web.StreamResponse:
    """Relay one request and its (possibly streamed) answer. Once the answer has begun, a
    failure cannot move the request elsewhere: an instance dying mid-answer cuts the answer
    short (and is logged), a client going away just ends the relay. A whole JSON answer's
    usage is checked against the index (`check_cached`)."""
    upstream = await _post(session, instance.url + http.path, raw)
    async with upstream:
        router.decisions[instance.name] += 1
        for tier, n in score.blocks_per_tier.items():
            router.hit_blocks[tier] += n
        headers = {
            "Content-Type": upstream.headers.get("Content-Type", "application/json"),
            "x-kvconnect-instance": instance.name,
        }
        response = web.StreamResponse(status=upstream.status, headers=headers)
        keep = check is not None and upstream.status == 200 and score.num_tokens > 0
        keep = keep and headers["Content-Type"].startswith("application/json")
        body: list[bytes] = []
        size = 0
        try:
            await response.prepare(http)
            async for data in upstream.content.iter_any():
                await response.write(data)
                if keep and size < MAX_CHECKED_BODY:
                    body.append(data)
                    size += len(data)
            await response.write_eof()
            if keep and check is not None and size < MAX_CHECKED_BODY:
                check_cached(router, instance.name, score, check, b"".join(body))
        except aiohttp.ClientPayloadError as e:
            logger.warning("router: %s failed mid-answer: %s", instance.name, e)
        except (ConnectionError, aiohttp.ClientConnectionError) as e:
            if http.transport is None or http.transport.is_closing():
                logger.info("router: client went away during the answer from %s", instance.name)
            else:
                logger.warning("router: %s failed mid-answer: %s", instance.name, e)
        return response


def run_router_command(args: Any) -> int:
    """`kvconnect router`: flags checked, tokenizer loaded, then routing until Ctrl-C."""
    from kvconnect.startup import check_port_free
    from kvconnect.tokenizer import load_tokenizer

    instances = [Instance.parse(spec) for spec in args.instance]
    try:
        pairs = [p.split("=") for p in args.tier_weights.split(",")]
        weights = {m: float(w) for m, w in pairs}
    except ValueError:
        raise ValueError(
            f"--tier-weights {args.tier_weights!r}: expected MEDIUM=WEIGHT,..."
        ) from None
    check_port_free(args.host, args.port, "--port")
    tokenizer = load_tokenizer(args.model)
    index = BlockIndex(
        args.block_size,
        hash_algorithm=args.hash_algorithm,
        hash_seed=args.hash_seed,
        max_entries=args.max_index_entries,
        tier_weights=weights,
    )
    router = Router(instances, index, tokenizer, args.load_weight)
    return asyncio.run(_run(router, args.host, args.port))


async def _run(router: Router, host: str, port: int) -> int:
    runner = web.AppRunner(make_app(router), access_log=None)
    await runner.setup()
    stop = asyncio.Event()
    try:
        await web.TCPSite(runner, host, port, shutdown_timeout=5).start()
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
        await runner.cleanup()
    return 0
