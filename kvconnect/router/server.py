"""`kvconnect router`: the HTTP front of several engine instances, routing by cached prefix.

    POST /v1/completions   tokenised, hashed like the engines, scored against the block index,
                           forwarded to the chosen instance; its answer (streamed or not) is
                           passed back with the header `x-kvconnect-instance`
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

from kvconnect.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from kvconnect.router.index import BlockIndex, InstanceId, PrefixScore
from kvconnect.router.scorer import choose
from kvconnect.subscriber import KVEventSubscriber

logger = logging.getLogger(__name__)
DOWN_SECONDS = 2.0


@dataclass(frozen=True)
class Instance:
    url: str
    events_endpoint: str
    replay_endpoint: str | None = None

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


def load_tokenizer(model: str) -> Tokenizer:
    if model == "tiny":
        return ByteTokenizer()
    from pathlib import Path

    return HFTokenizer(Path(model) / "tokenizer.json", None)


class Router:
    def __init__(
        self,
        instances: list[Instance],
        index: BlockIndex,
        tokenizer: Tokenizer,
        load_weight: float = 4.0,
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
        self._by_events = {i.events_endpoint: i for i in instances}
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
                self.index.apply_item(item.stream.endpoint, item)

    def scores(self, token_ids: list[int]) -> tuple[dict[str, PrefixScore], int]:
        hashes = self.index.request_hashes(token_ids)
        with self.lock:
            by_id = self.index.score_hashes(hashes)
        per_url: dict[str, PrefixScore] = {}
        for iid, score in by_id.items():
            inst = self._by_events.get(iid.endpoint)
            if inst is not None and score.weighted > per_url.get(inst.url, PrefixScore()).weighted:
                per_url[inst.url] = score
        return per_url, len(hashes)

    def pick(self, token_ids: list[int], exclude: set[str]) -> tuple[str, PrefixScore] | None:
        now = time.monotonic()
        urls = [
            i.url
            for i in self.instances
            if i.url not in exclude and self._down_until.get(i.url, 0) <= now
        ]
        if not urls:
            urls = [i.url for i in self.instances if i.url not in exclude]
        if not urls:
            return None
        scores, num_blocks = self.scores(token_ids)
        ids = [InstanceId(u) for u in urls]
        decision = choose(
            ids,
            {InstanceId(u): s for u, s in scores.items()},
            {InstanceId(u): self.in_flight[u] for u in urls},
            num_blocks,
            self.load_weight,
            {InstanceId(u): self.decisions[u] for u in urls},
        )
        return decision.instance.endpoint, decision.score

    def mark_down(self, url: str) -> None:
        self._down_until[url] = time.monotonic() + DOWN_SECONDS
        self.failures[url] += 1

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
        for url, n in sorted(self.decisions.items()):
            lines.append((f'kvconnect_router_decisions_total{{instance="{url}"}}', n))
        for url, n in sorted(self.in_flight.items()):
            lines.append((f'kvconnect_router_in_flight{{instance="{url}"}}', n))
        for url, n in sorted(self.failures.items()):
            lines.append((f'kvconnect_router_forward_failures_total{{instance="{url}"}}', n))
        for tier, n in sorted(self.hit_blocks.items()):
            lines.append((f'kvconnect_router_hit_blocks_total{{tier="{tier}"}}', n))
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

    async def completions(http: web.Request) -> web.StreamResponse:
        raw = await http.read()
        try:
            body = json.loads(raw)
            prompt = body["prompt"]
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                prompt = prompt[0]
            token_ids = (
                router.tokenizer.encode(prompt)
                if isinstance(prompt, str)
                else [int(t) for t in prompt]
            )
        except (ValueError, KeyError, TypeError) as e:
            return web.json_response({"error": {"message": f"bad request: {e}"}}, status=400)
        tried: set[str] = set()
        while True:
            picked = router.pick(token_ids, tried)
            if picked is None:
                return web.json_response(
                    {"error": {"message": "no instance is reachable"}}, status=503
                )
            url, score = picked
            tried.add(url)
            router.in_flight[url] += 1
            try:
                return await _forward(http, session["s"], url, raw, router, score)
            except aiohttp.ClientConnectionError as e:
                logger.warning("router: %s unreachable (%s); trying another instance", url, e)
                router.mark_down(url)
            finally:
                router.in_flight[url] -= 1

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "instances": [i.url for i in router.instances]})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=router.metrics(), content_type="text/plain")

    app = web.Application()
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def _forward(
    http: web.Request,
    session: aiohttp.ClientSession,
    url: str,
    raw: bytes,
    router: Router,
    score: PrefixScore,
) -> web.StreamResponse:
    async with session.post(
        url + "/v1/completions", data=raw, headers={"Content-Type": "application/json"}
    ) as upstream:
        router.decisions[url] += 1
        for tier, n in score.blocks_per_tier.items():
            router.hit_blocks[tier] += n
        headers = {
            "Content-Type": upstream.headers.get("Content-Type", "application/json"),
            "x-kvconnect-instance": url,
        }
        response = web.StreamResponse(status=upstream.status, headers=headers)
        await response.prepare(http)
        async for data in upstream.content.iter_any():
            await response.write(data)
        await response.write_eof()
        return response


def run_router(router: Router, host: str, port: int) -> None:
    web.run_app(make_app(router), host=host, port=port, print=None)
