"""`kvconnect serve`: one engine instance behind an OpenAI-compatible HTTP API.

    POST /v1/completions   {"prompt": str | [int], "max_tokens", "temperature", "seed",
                            "stream", "ignore_eos"}; streams server-sent events when asked
    GET  /health           200 when the engine runs
    GET  /metrics          Prometheus text: requests, tokens, cache hits per tier, events

The engine (`LLM`) is single-threaded: one thread owns it, takes new requests from a queue,
steps while there is work, and hands each request's new tokens to its HTTP handler through the
event loop. Binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvconnect.engine.llm import LLM
from kvconnect.engine.request import Request, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    prompt: str | list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    updates: asyncio.Queue[Any]
    request: Request | None = None
    sent: int = 0


@dataclass
class ServerMetrics:
    requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0
    external_tokens: int = 0


class EngineLoop:
    """The thread that owns the LLM."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.metrics = ServerMetrics()
        self._incoming: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._active: dict[str, _Pending] = {}
        self._thread = threading.Thread(target=self._run, name="kvconnect-engine", daemon=True)
        self.error: str | None = None
        self._thread.start()

    def submit(self, pending: _Pending) -> None:
        if self.error is not None:
            raise RuntimeError(self.error)
        self._incoming.put(pending)

    def stop(self) -> None:
        self._incoming.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        sched = self.llm.scheduler
        while True:
            busy = sched.has_unfinished_requests or sched.has_pending_transfers
            try:  # block only when idle; take every waiting request before the next step
                item = self._incoming.get_nowait() if busy else self._incoming.get(timeout=0.1)
            except queue.Empty:
                # Idle with a connector: step anyway now and then, so that stores finishing in
                # the background are reported and published without waiting for traffic.
                if not busy and self.llm.connector is None:
                    continue
            else:
                if item is None:
                    return
                self._add(item)
                continue
            try:
                self.llm.step()
            except Exception as e:  # the engine is gone: fail everyone
                self.error = f"engine failed: {e}"
                logger.exception("engine step failed")
                for p in self._active.values():
                    p.loop.call_soon_threadsafe(p.updates.put_nowait, ("error", self.error))
                self._active.clear()
                return
            self._push_updates()

    def _add(self, p: _Pending) -> None:
        try:
            p.request = self.llm.add_request(p.prompt, p.params, request_id=uuid.uuid4().hex)
        except ValueError as e:
            p.loop.call_soon_threadsafe(p.updates.put_nowait, ("invalid", str(e)))
            return
        self._active[p.request.request_id] = p

    def _push_updates(self) -> None:
        tok = self.llm.tokenizer
        for rid, p in list(self._active.items()):
            req = p.request
            assert req is not None
            if len(req.output_token_ids) > p.sent or req.status.is_finished:
                new = req.output_token_ids[p.sent :]
                before = len(tok.decode(req.output_token_ids[: p.sent]))
                text = tok.decode(req.output_token_ids)[before:]
                p.sent = len(req.output_token_ids)
                done = req.status.is_finished
                msg = ("tokens", new, text, req.status.finish_reason, req)
                p.loop.call_soon_threadsafe(p.updates.put_nowait, msg)
                if done:
                    m = self.metrics
                    m.requests += 1
                    m.prompt_tokens += len(req.prompt_token_ids)
                    m.generation_tokens += len(req.output_token_ids)
                    m.cached_tokens += req.num_cached_tokens or 0
                    m.external_tokens += req.num_external_tokens
                    del self._active[rid]


def _params(body: dict[str, Any]) -> SamplingParams:
    return SamplingParams(
        max_tokens=int(body.get("max_tokens", 16)),
        temperature=float(body.get("temperature", 0.0)),
        seed=body.get("seed"),
        ignore_eos=bool(body.get("ignore_eos", False)),
    )


def _chunk(
    rid: str, model: str, text: str, reason: str | None, extra: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}],
        **extra,
    }


def _usage(req: Request) -> dict[str, Any]:
    return {
        "usage": {
            "prompt_tokens": len(req.prompt_token_ids),
            "completion_tokens": len(req.output_token_ids),
            "total_tokens": len(req.prompt_token_ids) + len(req.output_token_ids),
        },
        "kv_cache": {
            "num_cached_tokens": req.num_cached_tokens or 0,
            "num_external_tokens": req.num_external_tokens,
        },
    }


def make_app(engine: EngineLoop, model_name: str) -> web.Application:
    async def completions(http: web.Request) -> web.StreamResponse:
        try:
            body = await http.json()
            if not isinstance(body, dict) or "prompt" not in body:
                raise ValueError("the body must be a JSON object with a prompt")
            prompt = body["prompt"]
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                prompt = prompt[0]
            params = _params(body)
        except (ValueError, TypeError, json.JSONDecodeError) as e:
            return web.json_response(
                {"error": {"message": str(e), "type": "invalid_request"}}, status=400
            )
        pending = _Pending(prompt, params, asyncio.get_running_loop(), asyncio.Queue())
        try:
            engine.submit(pending)
        except RuntimeError as e:
            return web.json_response({"error": {"message": str(e)}}, status=503)
        rid = f"cmpl-{uuid.uuid4().hex[:16]}"
        stream = bool(body.get("stream", False))
        response: web.StreamResponse | None = None
        if stream:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(http)
        texts: list[str] = []
        while True:
            kind, *rest = await pending.updates.get()
            if kind != "tokens":
                status = 400 if kind == "invalid" else 500
                if response is None:
                    return web.json_response({"error": {"message": rest[0]}}, status=status)
                await response.write(f"data: {json.dumps({'error': rest[0]})}\n\n".encode())
                break
            _, text, reason, req = rest
            texts.append(text)
            if response is not None:
                extra = _usage(req) if reason else {}
                payload = json.dumps(_chunk(rid, model_name, text, reason, extra))
                await response.write(f"data: {payload}\n\n".encode())
            if reason is not None:
                if response is None:
                    return web.json_response(
                        _chunk(rid, model_name, "".join(texts), reason, _usage(req))
                    )
                break
        assert response is not None
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def health(_: web.Request) -> web.Response:
        if engine.error:
            return web.json_response({"status": "error", "error": engine.error}, status=503)
        return web.json_response({"status": "ok"})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=engine_metrics(engine), content_type="text/plain")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


def engine_metrics(engine: EngineLoop) -> str:
    m, llm = engine.metrics, engine.llm
    stats = llm.scheduler.stats
    pub = llm.publisher
    lines = [
        ("kvconnect_requests_total", m.requests),
        ("kvconnect_prompt_tokens_total", m.prompt_tokens),
        ("kvconnect_generation_tokens_total", m.generation_tokens),
        ('kvconnect_prefix_cache_hit_tokens_total{tier="GPU"}', m.cached_tokens),
        ('kvconnect_prefix_cache_hit_tokens_total{tier="connector"}', m.external_tokens),
        ("kvconnect_preemptions_total", stats.num_preemptions),
        ("kvconnect_kv_events_total", stats.num_events_published),
        ("kvconnect_kv_event_batches_published_total", getattr(pub, "num_published", 0)),
        ("kvconnect_kv_event_batches_dropped_total", getattr(pub, "num_dropped", 0)),
        ("kvconnect_kv_cache_usage", llm.scheduler.pool.usage),
    ]
    cs = llm.scheduler.connector_stats
    if cs is not None:
        for k, v in sorted(cs.reduce().items()):
            if isinstance(v, int | float):
                lines.append((f"kvconnect_connector_{k}", v))
    return "".join(f"{name} {value}\n" for name, value in lines)


def serve(llm: LLM, host: str, port: int, model_name: str) -> None:
    """Run the API until interrupted."""
    engine = EngineLoop(llm)
    try:
        web.run_app(
            make_app(engine, model_name), host=host, port=port, print=None, handle_signals=True
        )
    finally:
        # Shutdown is bounded (workers are stopped within seconds); a second Ctrl-C must not
        # cut it short and leave worker processes behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        engine.stop()
        llm.shutdown()
