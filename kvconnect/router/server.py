"""`kvconnect router`: the HTTP front of several engine instances, routing by cached prefix.

    POST /v1/completions   tokenised, hashed like the engines, scored against the block index,
                           forwarded to the chosen instance; its answer (streamed or not) is
                           passed back with the header `x-kvconnect-instance`
    POST /kv/score         {"prompt": ...}: what each instance holds of it (nothing is sent)
    GET  /health, /metrics (routing decisions, hit blocks per tier, index size, events, gaps)

A subscriber thread follows every instance's event stream (with replay) and applies it to the
`BlockIndex` under a lock; the HTTP handlers score under the same lock. An instance that refuses
a connection is set aside for a moment and the request goes to the next best one. This module
never imports torch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from kvconnect.router.index import BlockIndex, PrefixScore
from kvconnect.router.scorer import DEFAULT_LOAD_WEIGHT, choose
from kvconnect.subscriber import KVEventSubscriber
from kvconnect.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
DOWN_SECONDS = 2.0


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
        if len(parts) not in (2, 3) or not parts[0].startswith("http"):
            raise ValueError(
                f"--instance {spec!r}: expected URL,EVENTS_ENDPOINT[,REPLAY_ENDPOINT] "
                "(e.g. http://127.0.0.1:8001,tcp://127.0.0.1:5557,tcp://127.0.0.1:5558)"
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
        self._down_until: dict[str, float] = {}
        self._by_name = {i.name: i for i in instances}
        if len(self._by_name) != len(instances):
            raise ValueError("each --instance must have its own URL")
        for inst in instances:
            index.add_instance(inst.name)
        # The subscriber names a stream by the endpoint it reads; that maps to one instance.
        self._name_by_endpoint = {i.events_endpoint: i.name for i in instances}
        self.subscriber = KVEventSubscriber(
            [i.events_endpoint for i in instances],
            [i.replay_endpoint for i in instances],
            start_seq=0,
        )
        self._thread = threading.Thread(target=self._follow, name="router-events", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        for item in self.subscriber:
            with self.lock:
                self.index.apply_item(self._name_by_endpoint[item.stream.endpoint], item)

    def scores(self, token_ids: list[int]) -> dict[str, PrefixScore]:
        """Per instance name, what it holds of the request's prefix."""
        with self.lock:
            return self.index.score(token_ids)

    def pick(self, token_ids: list[int], exclude: set[str]) -> tuple[Instance, PrefixScore] | None:
        """The instance to send the request to (not one in `exclude`), and its score."""
        now = time.monotonic()
        names = [
            i.name
            for i in self.instances
            if i.name not in exclude and self._down_until.get(i.name, 0) <= now
        ]
        if not names:
            names = [i.name for i in self.instances if i.name not in exclude]
        if not names:
            return None
        decision = choose(
            names,
            self.scores(token_ids),
            {n: self.in_flight[n] for n in names},
            len(token_ids),
            self.load_weight,
            {n: self.decisions[n] for n in names},
        )
        return self._by_name[decision.instance], decision.score

    def mark_down(self, name: str) -> None:
        self._down_until[name] = time.monotonic() + DOWN_SECONDS
        self.failures[name] += 1

    def close(self) -> None:
        self.subscriber.close()
        self._thread.join(timeout=2)

    def metrics(self) -> str:
        with self.lock:
            stats = self.index.stats
            lines = [
                ("kvconnect_router_index_entries", self.index.num_entries),
                ("kvconnect_router_events_applied_total", stats.events_applied),
                ("kvconnect_router_batches_applied_total", stats.batches_applied),
                ("kvconnect_router_instance_clears_total", stats.clears),
                ("kvconnect_router_publisher_restarts_total", stats.restarts),
                ("kvconnect_router_index_evictions_total", stats.entries_evicted),
                ("kvconnect_router_hash_mismatches_total", stats.hash_mismatches),
                ("kvconnect_router_gaps_repaired_total", self.subscriber.num_gaps_repaired),
                ("kvconnect_router_batches_lost_total", self.subscriber.num_batches_lost),
                (
                    "kvconnect_router_stale_instances",
                    sum(i.stale for i in self.index.instances.values()),
                ),
            ]
        for name, n in sorted(self.decisions.items()):
            lines.append((f'kvconnect_router_decisions_total{{instance="{name}"}}', n))
        for name, n in sorted(self.in_flight.items()):
            lines.append((f'kvconnect_router_in_flight{{instance="{name}"}}', n))
        for name, n in sorted(self.failures.items()):
            lines.append((f'kvconnect_router_forward_failures_total{{instance="{name}"}}', n))
        for tier, n in sorted(self.hit_blocks.items()):
            lines.append((f'kvconnect_router_hit_blocks_total{{tier="{tier}"}}', n))
        with self.lock:
            schemes = self.index.schemes()
        for name, (scheme, block_size) in sorted(schemes.items()):
            labels = f'instance="{name}",scheme="{scheme}",block_size="{block_size or 0}"'
            lines.append((f"kvconnect_router_instance_hash_scheme{{{labels}}}", 1))
        return "".join(f"{k} {v}\n" for k, v in lines)


def make_app(router: Router) -> web.Application:
    session: dict[str, aiohttp.ClientSession] = {}

    async def on_startup(_: web.Application) -> None:
        session["s"] = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5)
        )

    async def on_cleanup(_: web.Application) -> None:
        await session["s"].close()
        await asyncio.to_thread(router.close)

    def prompt_tokens(raw: bytes) -> list[int]:
        body = json.loads(raw)
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return router.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    async def completions(http: web.Request) -> web.StreamResponse:
        raw = await http.read()
        try:
            token_ids = prompt_tokens(raw)
        except (ValueError, KeyError, TypeError) as e:
            return web.json_response({"error": {"message": f"bad request: {e}"}}, status=400)
        tried: set[str] = set()
        while True:
            picked = router.pick(token_ids, tried)
            if picked is None:
                return web.json_response(
                    {"error": {"message": "no instance is reachable"}}, status=503
                )
            instance, score = picked
            name = instance.name
            tried.add(name)
            router.in_flight[name] += 1
            try:
                return await _forward(http, session["s"], instance, raw, router, score)
            except aiohttp.ClientConnectionError as e:
                logger.warning("router: %s unreachable (%s); trying another instance", name, e)
                router.mark_down(name)
            finally:
                router.in_flight[name] -= 1

    async def kv_score(http: web.Request) -> web.Response:
        """What each instance holds of a prompt, as the router sees it (no request is sent)."""
        try:
            token_ids = prompt_tokens(await http.read())
        except (ValueError, KeyError, TypeError) as e:
            return web.json_response({"error": {"message": f"bad request: {e}"}}, status=400)
        scores = router.scores(token_ids)
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
        return web.json_response({"status": "ok", "instances": [i.name for i in router.instances]})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=router.metrics(), content_type="text/plain")

    app = web.Application()
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/kv/score", kv_score)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def _forward(
    http: web.Request,
    session: aiohttp.ClientSession,
    instance: Instance,
    raw: bytes,
    router: Router,
    score: PrefixScore,
) -> web.StreamResponse:
    async with session.post(
        instance.url + "/v1/completions", data=raw, headers={"Content-Type": "application/json"}
    ) as upstream:
        router.decisions[instance.name] += 1
        for tier, n in score.blocks_per_tier.items():
            router.hit_blocks[tier] += n
        headers = {
            "Content-Type": upstream.headers.get("Content-Type", "application/json"),
            "x-kvconnect-instance": instance.name,
        }
        response = web.StreamResponse(status=upstream.status, headers=headers)
        await response.prepare(http)
        async for data in upstream.content.iter_any():
            await response.write(data)
        await response.write_eof()
        return response


def run_router(router: Router, host: str, port: int) -> None:
    web.run_app(make_app(router), host=host, port=port, print=None)
