"""`kvconnect serve`: one engine instance behind an OpenAI-compatible HTTP API.

    POST /v1/completions        prompt (a string, strings, token ids, lists of token ids), n,
                                stop, stop_token_ids, max_tokens, temperature, top_p, top_k,
                                seed, stream (+ stream_options.include_usage), cache_salt
    POST /v1/chat/completions   messages rendered with the model's chat template; the same
                                sampling fields; streamed as deltas when asked
    GET  /v1/models             the one model served
    POST /tokenize              vLLM's: a prompt, or messages rendered as chat completions
                                renders them -> count, max_model_len, tokens (token_strs)
    POST /detokenize            vLLM's: tokens -> prompt (the text, special tokens kept)
    GET  /version               kvconnect's version, as vLLM answers with its own
    GET  /health                200 while the engine runs, 503 once it failed
    GET  /metrics               Prometheus (see metrics.py)

Every request is validated here (`api/protocol.py`) and tokenized; the engine checks each
prompt against its limits, once, when it takes the job, and the server answers only after
that verdict: a prompt the engine cannot run is a 400 in OpenAI's error body, never a stream
that starts and then fails. The engine runs on its own thread (`engine_loop.py`), and the
server knows it only through that loop (`EngineLoop.info`: tokenizer, limits). When the engine
fails the server answers 503, logs one line and exits with status 1, so that a supervisor
restarts it. Binds 127.0.0.1 unless told otherwise; one access log line per request.

Trust (`ServeOptions`): the listener (`api/connections.py`) caps connections and gives request
heads and bodies deadlines; `api/auth.py` checks the Bearer key when one is set; a client that
goes away cancels its handler, whose `finally` aborts its engine requests; `admission.py`
refuses work beyond the waiting limits with a 503 before anything reaches the engine; a
deadline (`request_timeout`) aborts a generation with a 504; cached prompt tokens are told only
with `enable_prompt_tokens_details`.

/tokenize answers with the tokens the engine runs for the same prompt or messages, so that a
router that tokenizes through it (vllm-router does) hashes the blocks this instance publishes.
`add_special_tokens` is accepted and adds nothing, because kvconnect puts no special tokens
around a prompt in any endpoint. For SmolLM2 that is vLLM's answer too: a byte-level BPE gets
a BOS only when its file says `add_bos_token`, and SmolLM2's does not; the byte model (tiny,
kvconnect's own) never starts a prompt with its BOS. A checkpoint whose tokenizer.json adds a
BOS (Llama's) would get one from vLLM and gets none here, in /tokenize as in completions.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass, field
from typing import Any

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
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    parse,
    parse_tokenize,
)
from kvconnect.api.responses import DONE, Envelope, Usage, sse
from kvconnect.engine.llm import LLM
from kvconnect.engine.request import Request, SamplingParams
from kvconnect.serve.admission import RETRY_AFTER_S, Admission
from kvconnect.serve.engine_loop import EngineLoop, Failed, Job, Update
from kvconnect.serve.metrics import ServeMetrics
from kvconnect.tokenizer import (
    BYTE_BOS,
    BYTE_EOS,
    ByteTokenizer,
    ChatTemplateError,
    HFTokenizer,
    Tokenizer,
)

logger = logging.getLogger(__name__)


@dataclass
class Prepared:
    """A validated request turned into engine jobs."""

    prompts: list[list[int]]
    jobs: list[list[Job]]  # per prompt, its n choices
    param: str
    """The request field the prompts came from, named in a refusal."""

    @property
    def all_jobs(self) -> list[Job]:
        return [job for choices in self.jobs for job in choices]


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
    api_key: str | None = field(default=None, repr=False)
    admin_token: str | None = field(default=None, repr=False)
    limits: ConnectionLimits = field(default_factory=ConnectionLimits)

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
    ):
        self.engine = engine
        self.info = engine.info
        self.model_name = model_name
        self.metrics = metrics
        self.options = options or ServeOptions()
        self.admission = Admission(
            self.options.max_num_waiting,
            self.options.max_num_waiting_tokens,
            max_prompt_tokens=self.info.max_model_len,
        )

    # -- preparing ----------------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(
                f"the model `{model}` does not exist; this server serves `{self.model_name}`",
                "model",
                status=404,
                code="model_not_found",
            )

    def _prepare(
        self, req: CompletionRequest | ChatCompletionRequest, loop: asyncio.AbstractEventLoop
    ) -> Prepared:
        """Tokenize (rendering a chat) and build the jobs; the engine checks the prompts when
        it takes them. Runs on a worker thread: a huge prompt must not stall the event loop."""
        tok = self.info.tokenizer
        if isinstance(req, ChatCompletionRequest):
            prompts = [tok.encode(self._render(req.conversation(), req.add_generation_prompt))]
            param = "messages"
        else:
            prompts = [p if isinstance(p, list) else tok.encode(p) for p in req.prompts()]
            param = "prompt"
        jobs = []
        for tokens in prompts:
            max_tokens = self._max_tokens(req, len(tokens))
            jobs.append(
                [
                    Job(tokens, self._params(req, max_tokens, j), loop, cache_salt=req.cache_salt)
                    for j in range(req.n)
                ]
            )
        return Prepared(prompts, jobs, param)

    def _render(
        self,
        conversation: list[dict[str, str]],
        add_generation_prompt: bool,
        continue_final_message: bool = False,
    ) -> str:
        """The chat as the model's template renders it; `ApiError` naming `messages` if not."""
        try:
            text = self.info.tokenizer.apply_chat_template(conversation, add_generation_prompt)
        except ChatTemplateError as e:
            raise ApiError(str(e), "messages") from None
        if continue_final_message:
            return _continue_final(text, conversation[-1]["content"])
        return text

    def _max_tokens(self, req: CompletionRequest | ChatCompletionRequest, num_prompt: int) -> int:
        if isinstance(req, ChatCompletionRequest):
            given = req.completion_tokens
            return given if given is not None else max(1, self.info.max_model_len - num_prompt)
        return req.max_tokens

    @staticmethod
    def _params(
        req: CompletionRequest | ChatCompletionRequest, max_tokens: int, j: int
    ) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k in (None, -1) else req.top_k,
            seed=None if req.seed is None else (req.seed + j) % 2**63,
            stop=req.stops,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
        )

    # -- handlers -----------------------------------------------------------------------------

    async def completions(self, http: web.Request) -> web.StreamResponse:
        return await self._generate(http, chat=False)

    async def chat_completions(self, http: web.Request) -> web.StreamResponse:
        return await self._generate(http, chat=True)

    async def _generate(self, http: web.Request, chat: bool) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        deadline = self._deadline(loop)
        req: CompletionRequest | ChatCompletionRequest
        try:
            body = await read_body(http)
            req = parse(body, ChatCompletionRequest) if chat else parse(body, CompletionRequest)
            self._check_model(req.model)
            prepared = await asyncio.to_thread(self._prepare, req, loop)
        except ApiError as e:
            return error_response(e)
        jobs = prepared.all_jobs
        overloaded = self.admission.admit(jobs)
        if overloaded is not None:
            response = error_response(overloaded)
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
            return response
        try:
            async with asyncio.timeout_at(None if req.stream else deadline):
                refused = await self._submit(jobs)
                if refused is not None:
                    return error_response(_failure(refused, prepared.param))
                envelope = Envelope(chat=chat, model=self.model_name)
                if not req.stream:
                    return await self._collect(envelope, prepared, req.return_token_ids)
            return await self._stream(
                http, envelope, prepared, req.include_usage, req.return_token_ids, deadline
            )
        except TimeoutError:
            return error_response(self._timed_out())
        finally:
            # What is still running when the client is gone (the handler is cancelled), on
            # a deadline or on error.
            self._abort(jobs)

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

    async def _collect(
        self, envelope: Envelope, prepared: Prepared, return_ids: bool
    ) -> web.Response:
        choices: list[dict[str, Any]] = []
        finals: list[Request] = []
        for choices_of_prompt in prepared.jobs:
            for job in choices_of_prompt:
                text: list[str] = []
                while True:
                    update = await job.updates.get()
                    if isinstance(update, Failed):
                        return error_response(_failure(update))
                    text.append(update.text)
                    if update.request is not None:
                        break
                final = update.request
                ids = (job.prompt, list(final.output_token_ids)) if return_ids else None
                choices.append(
                    envelope.choice(
                        len(choices), "".join(text), update.finish_reason, update.stop_reason, ids
                    )
                )
                finals.append(update.request)
        return web.json_response(envelope.body(choices, self._usage(prepared, finals)))

    async def _stream(
        self,
        http: web.Request,
        envelope: Envelope,
        prepared: Prepared,
        include_usage: bool,
        return_ids: bool,
        deadline: float | None,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(http)
        merged: asyncio.Queue[tuple[int, Update | Failed]] = asyncio.Queue()
        jobs = prepared.all_jobs

        async def forward(index: int, job: Job) -> None:
            while True:
                update = await job.updates.get()
                await merged.put((index, update))
                if isinstance(update, Failed) or update.request is not None:
                    return

        tasks = [asyncio.create_task(forward(i, job)) for i, job in enumerate(jobs)]
        try:
            async with asyncio.timeout_at(deadline):
                finals = await self._relay(response, envelope, merged, jobs, return_ids)
            if finals is not None and include_usage:
                await response.write(envelope.usage_chunk(self._usage(prepared, finals)))
        except TimeoutError:
            await response.write(sse(self._timed_out().body()))
        finally:
            for t in tasks:
                t.cancel()
        await response.write(DONE)
        await response.write_eof()
        return response

    async def _relay(
        self,
        response: web.StreamResponse,
        envelope: Envelope,
        merged: asyncio.Queue[tuple[int, Update | Failed]],
        jobs: list[Job],
        return_ids: bool,
    ) -> list[Request] | None:
        """Each job's updates as chunks, until all finished (their requests) or one failed
        (None, its error sent)."""
        finals: list[Request | None] = [None] * len(jobs)
        started = [False] * len(jobs)
        remaining = len(jobs)
        while remaining:
            index, update = await merged.get()
            if isinstance(update, Failed):
                await response.write(sse(_failure(update).body()))
                return None
            if update.text or not started[index] or update.request is not None:
                ids = (jobs[index].prompt, update.token_ids) if return_ids else None
                await response.write(
                    envelope.chunk(
                        index,
                        update.text,
                        update.finish_reason,
                        update.stop_reason,
                        first=not started[index],
                        token_ids=ids,
                    )
                )
                started[index] = True
            if update.request is not None:
                finals[index] = update.request
                remaining -= 1
        return [r for r in finals if r is not None]

    def _usage(self, prepared: Prepared, finals: list[Request]) -> Usage:
        """Prompt tokens once per prompt (its n choices share it), all generated tokens;
        cached prompt tokens only when asked for (`enable_prompt_tokens_details`)."""
        usage = Usage(completion_tokens=sum(len(r.output_token_ids) for r in finals))
        n = len(prepared.jobs[0]) if prepared.jobs else 1
        cached = 0
        for first in finals[::n]:
            usage.prompt_tokens += len(first.prompt_token_ids)
            cached += (first.num_cached_tokens or 0) + first.num_external_tokens
        if self.options.enable_prompt_tokens_details:
            usage.cached_tokens = cached
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
            body = await asyncio.to_thread(self._tokenize, req)
        except ApiError as e:
            return error_response(e)
        return web.Response(body=body, content_type="application/json")

    def _tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> bytes:
        """The response body: the prompt's tokens as the engine would run them. Runs on a
        worker thread, as `_prepare` does."""
        tok = self.info.tokenizer
        if isinstance(req, TokenizeChatRequest):
            text = self._render(
                req.conversation(), req.add_generation_prompt, req.continue_final_message
            )
            tokens, param = tok.encode(text), "messages"
        else:
            tokens, param = tok.encode(req.prompt), "prompt"
        self._check_length(len(tokens), param)
        return msgspec.json.encode(
            {
                "count": len(tokens),
                "max_model_len": self.info.max_model_len,
                "tokens": tokens,
                "token_strs": _token_strs(tok, tokens) if req.return_token_strs else None,
            }
        )

    async def detokenize(self, http: web.Request) -> web.Response:
        try:
            req = parse(await read_body(http), DetokenizeRequest)
            self._check_model(req.model)
            body = await asyncio.to_thread(self._detokenize, req.tokens)
        except ApiError as e:
            return error_response(e)
        return web.Response(body=body, content_type="application/json")

    def _detokenize(self, tokens: list[int]) -> bytes:
        vocab = self.info.vocab_size
        bad = next((i for i, t in enumerate(tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(
                f"tokens[{bad}]={tokens[bad]} is not in the vocabulary [0, {vocab})", "tokens"
            )
        self._check_length(len(tokens), "tokens")
        return msgspec.json.encode({"prompt": _decode(self.info.tokenizer, tokens)})

    def _check_length(self, num_tokens: int, param: str) -> None:
        """vLLM's limit on both endpoints: no more tokens than the model's context."""
        limit = self.info.max_model_len
        if num_tokens > limit:
            raise ApiError(
                f"{param}: {num_tokens} tokens is more than the model's context of {limit} "
                "tokens (max_model_len)",
                param,
            )

    async def version(self, _: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    async def health(self, _: web.Request) -> web.Response:
        if self.engine.error:
            return web.json_response({"status": "error", "error": self.engine.error}, status=503)
        return web.json_response({"status": "ok"})

    async def prometheus(self, _: web.Request) -> web.Response:
        text = await asyncio.to_thread(self.metrics.render)
        return web.Response(body=text, content_type="text/plain", charset="utf-8")


def _failure(update: Failed, param: str | None = None) -> ApiError:
    if update.status == 400:
        return ApiError(update.message, param)
    return ApiError(update.message, status=update.status, type_="service_unavailable")


def _continue_final(text: str, final: str) -> str:
    """The rendered chat cut right after the final message's content (no end of turn, no next
    header), as transformers' `continue_final_message` cuts it: after the content as the
    template kept it, trailing spaces included only if the template kept them."""
    at = text.rfind(final.strip())
    if at < 0:
        raise ApiError(
            "continue_final_message: the final message's content is not in the rendered chat",
            "continue_final_message",
        )
    kept = len(final.lstrip())
    if text[at : at + kept] == final:
        return text[: at + kept]
    return text[: at + len(final.strip())]


def _token_strs(tok: Tokenizer, tokens: list[int]) -> list[str]:
    """Each token's piece of the vocabulary, as vLLM's `convert_ids_to_tokens` gives it (a
    byte-level BPE writes a leading space as "Ġ"). The byte model's pieces: printable ASCII as
    itself, any other byte as "<0xNN>" (how byte-fallback vocabularies name bytes), and its
    two specials as "<bos>", "<eos>"."""
    if isinstance(tok, HFTokenizer):
        # `Tokenizer` offers no piece lookup: the `tokenizers` object behind it does.
        return [tok._tok.id_to_token(t) or "" for t in tokens]
    if isinstance(tok, ByteTokenizer):
        return [_BYTE_PIECES.get(t) or _byte_piece(t) for t in tokens]
    return [tok.decode([t]) for t in tokens]


_BYTE_PIECES = {BYTE_BOS: "<bos>", BYTE_EOS: "<eos>"}


def _byte_piece(t: int) -> str:
    return chr(t) if 0x20 <= t < 0x7F else f"<0x{t:02X}>"


def _decode(tok: Tokenizer, tokens: list[int]) -> str:
    """The text of `tokens` with special tokens kept, as vLLM's /detokenize decodes (so that a
    rendered chat comes back whole); the byte model's specials have no text."""
    if isinstance(tok, HFTokenizer):
        # `Tokenizer.decode` drops special tokens (for generated text): decode underneath.
        return str(tok._tok.decode(tokens, skip_special_tokens=False))
    return tok.decode(tokens)


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
    server = OpenAIServer(engine, model_name, metrics, options)
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
