"""`kvconnect serve`: one engine instance behind an OpenAI-compatible HTTP API.

    POST /v1/completions        prompt (a string, strings, token ids, lists of token ids), n,
                                stop, stop_token_ids, max_tokens, temperature, top_p, top_k,
                                seed, stream (+ stream_options.include_usage), cache_salt;
                                presence/frequency/repetition penalties, min_p, min_tokens,
                                logit_bias, bad_words; logprobs, echo, prompt_logprobs
    POST /v1/chat/completions   messages rendered with the model's chat template; the same
                                sampling fields, logprobs + top_logprobs; streamed as deltas
                                when asked; tools with tool_choice required, named or none
                                (answered as tool_calls: tool_calls.py)
    (both)                      structured output: response_format json_object/json_schema,
                                vLLM's structured_outputs (json, regex, choice, grammar),
                                through xgrammar in the engine's sampler
    GET  /v1/models             the one model served
    POST /tokenize              vLLM's: a prompt, or messages rendered as chat completions
                                renders them -> count, max_model_len, tokens (token_strs)
    POST /detokenize            vLLM's: tokens -> prompt (the text, special tokens kept)
    GET  /version               kvconnect's version, as vLLM answers with its own
    GET  /kv_event_sources      where the KV event streams are, vLLM's list (PR #55844): one
                                {data_parallel_rank, endpoint, replay_endpoint, topic} per
                                rank, the ports as bound, a wildcard host given as the address
                                the request came in on; [] when events are off
    GET  /health                200 while the engine runs, 503 once it failed (status
                                "error") or while its connector is stuck ("stalled")
    GET  /metrics               Prometheus (see metrics.py)

Every request is validated (`api/protocol.py`) and turned into jobs (`prepare.py`); the
engine checks each prompt against its limits, once, when it takes the job, and the server
answers only after that verdict (`answers.py` builds the answer): a prompt the engine cannot
run is a 400 in OpenAI's error body, never a stream that starts and then fails. The engine
runs on its own thread (`engine_loop.py`), and the server knows it only through that loop
(`EngineLoop.info`: tokenizer, limits). When the engine fails the server answers 503, logs
one line and exits with status 1, so that a supervisor restarts it. Binds 127.0.0.1 unless
told otherwise; one access log line per request.

Trust (`ServeOptions`): the listener (`http/aiohttp_listener.py`) caps connections and gives
request heads and bodies deadlines; `http/auth.py` checks the Bearer key when one is set; a
client that goes away cancels its handler, whose `finally` aborts its engine requests;
`admission.py` refuses work beyond the waiting limits with a 503 before anything reaches the
engine; a deadline (`request_timeout`) aborts a generation with a 504; cached prompt tokens are
told only with `enable_prompt_tokens_details`.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections import Counter
from dataclasses import dataclass, field

import msgspec
from aiohttp import web

from kvconnect import __version__
from kvconnect.api.protocol import (
    MAX_BODY_BYTES,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    parse,
)
from kvconnect.api.responses import Envelope, Usage
from kvconnect.api.tokenize import DetokenizeRequest, parse_tokenize
from kvconnect.engine.llm import LLM
from kvconnect.engine.request import Request
from kvconnect.http.aiohttp_app import access_and_errors, error_response, read_body
from kvconnect.http.aiohttp_listener import Listener
from kvconnect.http.auth import BearerAuth, client_of
from kvconnect.http.limits import ConnectionLimits
from kvconnect.serve.admission import RETRY_AFTER_S, Admission
from kvconnect.serve.answers import Answer, Shown, failure
from kvconnect.serve.engine_loop import EngineLoop, Failed, Job
from kvconnect.serve.logprobs import TokenText
from kvconnect.serve.metrics import ServeMetrics, cached_by_source
from kvconnect.serve.prepare import (
    GenerateRequest,
    Prepared,
    num_logprobs,
    num_prompt_logprobs,
    prepare,
)
from kvconnect.serve.tokens import detokenize_body, tokenize_body
from kvconnect.stream.wire import KVEventSource, with_host
from kvconnect.transfer_params import LEASE_OWNER, check_source, source_of

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeOptions:
    """How the API treats its clients (the flags of `kvconnect serve` beyond the engine's)."""

    max_num_waiting: int = 1024
    """Engine requests waiting for their first output at most (`admission.py`)."""
    max_num_waiting_tokens: int = 1 << 20
    """Their prompt tokens at most."""
    request_timeout: float | None = None
    """Seconds a generation may take from its arrival; then its engine requests are aborted
    and it is answered 504 (or its stream ends with that error). None: no deadline."""
    enable_prompt_tokens_details: bool = False
    """`usage.prompt_tokens_details.cached_tokens` in answers, as vLLM's flag of that name."""
    api_key: str | tuple[str, ...] | None = field(default=None, repr=False)
    """One key, or several (one a client: lease quotas count per client, `client_of`)."""
    admin_token: str | None = field(default=None, repr=False)
    limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    peer_sources: frozenset[tuple[str, int]] = frozenset()
    """The peers a request's `kv_transfer_params` may name (the offload connector's
    `peer.sources`); any other is a 400 naming the key."""
    peer_pd: bool = True
    """Whether P/D params (`do_remote_prefill`) name kvconnect peers (`peer.pd`)."""

    def __post_init__(self) -> None:
        if self.request_timeout is not None and not 0 < self.request_timeout < float("inf"):
            raise ValueError(f"--request-timeout {self.request_timeout}: must be positive")


class OpenAIServer:
    def __init__(
        self,
        engine: EngineLoop,
        model_name: str,
        metrics: ServeMetrics,
        options: ServeOptions | None = None,
        event_sources: list[KVEventSource] | None = None,
    ):
        """`event_sources`: the publisher's streams, by DP rank (none: events off)."""
        self.engine = engine
        self.event_sources = sorted(event_sources or [], key=lambda s: s.data_parallel_rank)
        self.info = engine.info
        self.model_name = model_name
        self.metrics = metrics
        self.options = options or ServeOptions()
        self.admission = Admission(
            self.options.max_num_waiting,
            self.options.max_num_waiting_tokens,
            max_prompt_tokens=self.info.max_model_len,
        )
        self._token_text = TokenText(self.info.tokenizer)

    # -- preparing ----------------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(
                f"the model `{model}` does not exist; this server serves `{self.model_name}`",
                "model",
                status=404,
                code="model_not_found",
            )

    def _check_source(self, req: GenerateRequest) -> None:
        """A peer named in `kv_transfer_params` must be a configured one: a client names
        peers, never where this instance connects."""
        params = req.transfer()
        named = None if params is None else source_of(params, self.options.peer_pd)
        if named is not None:
            try:
                check_source(named, self.options.peer_sources)
            except ValueError as e:
                raise ApiError(str(e), "kv_transfer_params") from None

    def _own_leases(self, jobs: list[Job], authorization: str | None) -> None:
        """A P/D prefill's lease is its client's (the API key it came with): lease quotas
        count per client (`peer.max_leased_share_per_client`)."""
        client = client_of(authorization) if self.options.api_key else None
        for job in jobs:
            params = job.kv_transfer_params
            if client is not None and params and params.get("do_remote_decode"):
                job.kv_transfer_params = {**params, LEASE_OWNER: client}

    # -- handlers -----------------------------------------------------------------------------

    async def completions(self, http: web.Request) -> web.StreamResponse:
        return await self._generate(http, chat=False)

    async def chat_completions(self, http: web.Request) -> web.StreamResponse:
        return await self._generate(http, chat=True)

    async def _generate(self, http: web.Request, chat: bool) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        deadline = self._deadline(loop)
        req: GenerateRequest
        try:
            body = await read_body(http)
            req = parse(body, ChatCompletionRequest) if chat else parse(body, CompletionRequest)
            self._check_model(req.model)
            self._check_source(req)
            prepared = await asyncio.to_thread(prepare, req, self.info, loop)
        except ApiError as e:
            return error_response(e)
        jobs = prepared.all_jobs
        self._own_leases(jobs, http.headers.get("Authorization"))
        overloaded = self.admission.admit(jobs)
        if overloaded is not None:
            response = error_response(overloaded)
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
            return response
        try:
            async with asyncio.timeout_at(None if req.stream else deadline):
                refused = await self._submit(jobs)
                if refused is not None:
                    return error_response(failure(refused, prepared.param))
                answer = self._answer(req, prepared, chat)
                if not req.stream:
                    return await answer.collect()
            return await answer.stream(http, deadline, self._timed_out)
        except TimeoutError:
            return error_response(self._timed_out())
        finally:
            # What is still running when the client is gone (the handler is cancelled), on
            # a deadline or on error.
            self._abort(jobs)

    def _answer(self, req: GenerateRequest, prepared: Prepared, chat: bool) -> Answer:
        shown = Shown(
            logprobs=num_logprobs(req),
            echo=isinstance(req, CompletionRequest) and req.echo,
            echo_only=isinstance(req, CompletionRequest) and req.max_tokens == 0,
            prompt_logprobs=num_prompt_logprobs(req) is not None,
            return_token_ids=req.return_token_ids,
            include_usage=req.include_usage,
            forced_tool=prepared.forced_tool,
        )
        envelope = Envelope(chat=chat, model=self.model_name)
        return Answer(
            envelope,
            prepared,
            shown,
            self._token_text,
            lambda finals: self._usage(prepared, finals),
        )

    def _deadline(self, loop: asyncio.AbstractEventLoop) -> float | None:
        timeout = self.options.request_timeout
        return None if timeout is None else loop.time() + timeout

    def _timed_out(self) -> ApiError:
        return ApiError(
            f"the request did not finish within {self.options.request_timeout:g} s "
            "(--request-timeout)",
            status=504,
            type_="timeout",
        )

    async def _submit(self, jobs: list[Job]) -> Failed | None:
        """Hand every job to the engine and wait for its verdicts: None once it has taken
        them all, else the first refusal (the engine is gone: 503; a prompt it cannot run:
        400)."""
        try:
            for job in jobs:
                self.engine.submit(job)
        except RuntimeError as e:
            return Failed(str(e), 503)
        for job in jobs:
            verdict = await job.admitted
            if verdict is not None:
                return verdict
        return None

    def _abort(self, jobs: list[Job]) -> None:
        self.admission.release(jobs)
        for job in jobs:
            self.engine.abort(job)

    def _usage(self, prepared: Prepared, finals: list[Request]) -> Usage:
        """Prompt tokens once per prompt (its n choices share it), all generated tokens;
        cached prompt tokens only when asked for (`enable_prompt_tokens_details`)."""
        usage = Usage(completion_tokens=sum(len(r.output_token_ids) for r in finals))
        n = len(prepared.jobs[0]) if prepared.jobs else 1
        by_source: Counter[str] = Counter()
        for first in finals[::n]:
            usage.prompt_tokens += len(first.prompt_token_ids)
            by_source.update(cached_by_source(first))
        if self.options.enable_prompt_tokens_details:
            usage.cached_tokens = by_source.total()
            usage.cached_tokens_by_source = dict(+by_source)
        return usage

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "kvconnect",
                        "max_model_len": self.info.max_model_len,
                    }
                ],
            }
        )

    # -- vLLM's tokenizer endpoints ------------------------------------------------------------

    async def tokenize(self, http: web.Request) -> web.Response:
        try:
            req = parse_tokenize(await read_body(http))
            self._check_model(req.model)
            body = await asyncio.to_thread(tokenize_body, self.info, req)
        except ApiError as e:
            return error_response(e)
        return web.Response(body=body, content_type="application/json")

    async def detokenize(self, http: web.Request) -> web.Response:
        try:
            req = parse(await read_body(http), DetokenizeRequest)
            self._check_model(req.model)
            body = await asyncio.to_thread(detokenize_body, self.info, req.tokens)
        except ApiError as e:
            return error_response(e)
        return web.Response(body=body, content_type="application/json")

    async def kv_event_sources(self, http: web.Request) -> web.Response:
        sockname = http.transport.get_extra_info("sockname") if http.transport else None
        host = str(sockname[0]) if sockname else "127.0.0.1"
        sources = [
            msgspec.structs.replace(
                s,
                endpoint=with_host(s.endpoint, host),
                replay_endpoint=s.replay_endpoint and with_host(s.replay_endpoint, host),
            )
            for s in self.event_sources
        ]
        return web.Response(body=msgspec.json.encode(sources), content_type="application/json")

    async def version(self, _: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    async def health(self, _: web.Request) -> web.Response:
        if self.engine.error:
            return web.json_response({"status": "error", "error": self.engine.error}, status=503)
        stuck = await asyncio.to_thread(self.engine.stalled)
        if stuck is not None:
            return web.json_response({"status": "stalled", "error": stuck}, status=503)
        return web.json_response({"status": "ok"})

    async def prometheus(self, _: web.Request) -> web.Response:
        text = await asyncio.to_thread(self.metrics.render)
        return web.Response(body=text, content_type="text/plain", charset="utf-8")


def make_app(server: OpenAIServer) -> web.Application:
    auth = BearerAuth(server.options.api_key, server.options.admin_token)
    middlewares = [access_and_errors, auth.middleware()] if auth.enabled else [access_and_errors]
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES + 1)
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_post("/v1/chat/completions", server.chat_completions)
    app.router.add_get("/v1/models", server.models)
    app.router.add_post("/tokenize", server.tokenize)
    app.router.add_post("/detokenize", server.detokenize)
    app.router.add_get("/version", server.version)
    app.router.add_get("/kv_event_sources", server.kv_event_sources)
    app.router.add_get("/health", server.health)
    app.router.add_get("/metrics", server.prometheus)
    return app


def serve(
    llm: LLM,
    host: str,
    port: int,
    model_name: str,
    ready: str = "",
    options: ServeOptions | None = None,
) -> int:
    """Run the API until interrupted (0) or until the engine fails (1)."""
    return asyncio.run(_serve(llm, host, port, model_name, ready, options or ServeOptions()))


async def _serve(
    llm: LLM, host: str, port: int, model_name: str, ready: str, options: ServeOptions
) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    exit_code = 0

    def fatal(_: str) -> None:
        nonlocal exit_code
        exit_code = 1
        loop.call_soon_threadsafe(stop.set)

    metrics = ServeMetrics(model_name, llm.stats)

    def finished(job: Job, request: Request) -> None:
        ttft = None if job.first_token_at is None else job.first_token_at - job.submitted
        metrics.finished(request, ttft, time.monotonic() - job.submitted)

    engine = EngineLoop(llm, on_fatal=fatal, on_finished=finished)
    source = llm.publisher.source()
    server = OpenAIServer(engine, model_name, metrics, options, [source] if source else [])
    listener = Listener(make_app(server), options.limits)
    try:
        await listener.start(host, port)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        print(
            f"kvconnect serve: ready at http://{host}:{port} (model {model_name}){ready}",
            flush=True,
        )
        await stop.wait()
    finally:
        await listener.close()
        await asyncio.to_thread(engine.stop)
    return exit_code


__all__ = ["OpenAIServer", "ServeOptions", "make_app", "serve"]
