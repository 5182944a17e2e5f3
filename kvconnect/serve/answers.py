"""The answer to a completion or chat request, from its jobs' updates: whole, or streamed.

    Answer(envelope, prepared, shown, text, usage).collect()   -> one JSON body
    Answer(...).stream(http, deadline, timed_out)              -> SSE chunks, then [DONE]

Both build each choice with a `ChoiceView`, update by update (a whole answer is its updates
joined into one): with `echo` the first carries the prompt's text, token ids and logprobs
before the output's; a completion's `text_offset` runs on across chunks. A stream sends a
chunk when an update has text or tokens whose logprobs or ids were asked for, for the first and
for the last; a failure is sent as the stream's last chunk before [DONE].
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvconnect.api.protocol import ApiError
from kvconnect.api.responses import DONE, Envelope, Usage, sse
from kvconnect.engine.request import Request
from kvconnect.http.aiohttp_app import error_response
from kvconnect.messages import PositionLogprobs
from kvconnect.serve.engine_loop import Failed, Job, Update
from kvconnect.serve.logprobs import (
    CONTEXT,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    output_contexts,
    prompt_contexts,
    prompt_logprobs,
)
from kvconnect.serve.prepare import Prepared
from kvconnect.serve.tool_calls import ToolCallStream, finish_reason, whole_calls


@dataclass(frozen=True)
class Shown:
    """What the client asked to see of each choice beyond its text."""

    logprobs: int | None = None
    """Alternatives per output token; None: no logprobs."""
    echo: bool = False
    echo_only: bool = False
    """The prompt alone, not the output (echo with max_tokens 0)."""
    prompt_logprobs: bool = False
    """vLLM's `prompt_logprobs` in a whole answer (asked for, or computed for echo)."""
    return_token_ids: bool = False
    include_usage: bool = False
    forced_tool: str | None = None
    """The function every choice calls ("" for any of the tools): its output is shown as
    `tool_calls` (serve/tool_calls.py); None: as text."""


@dataclass
class ChoiceView:
    """One choice's pieces, update by update."""

    envelope: Envelope
    shown: Shown
    job: Job
    prompt_text: str
    text: TokenText
    offset: int = 0
    """Where the next token's text starts in the choice's text (`text_offset`)."""
    echoed: bool = field(default=False, init=False)
    output: list[int] = field(default_factory=list, init=False)
    """The last output tokens so far: the next tokens' text context."""
    calls: ToolCallStream | None = field(default=None, init=False)
    """A streamed forced tool call's state."""

    def __post_init__(self) -> None:
        if self.shown.forced_tool is not None:
            self.calls = ToolCallStream(self.shown.forced_tool)

    def logprobs(self, update: Update) -> tuple[str, dict[str, Any] | None]:
        """The text and `logprobs` this update adds to the choice."""
        text, token_ids = update.text, update.token_ids
        positions: list[PositionLogprobs | None] = list(update.logprobs or ())
        contexts = output_contexts(self.output, token_ids)
        self.output = [*self.output, *token_ids][-CONTEXT:]
        if self.shown.echo_only:
            text, token_ids, positions, contexts = "", [], [], []
        if self.shown.echo and not self.echoed:
            self.echoed = True
            prompt = self.job.prompt
            text, token_ids = self.prompt_text + text, prompt + token_ids
            positions = list(update.prompt_logprobs or [None] * len(prompt)) + positions
            contexts = prompt_contexts(prompt) + contexts
        if self.shown.logprobs is None:
            return text, None
        if self.envelope.chat:
            chosen = [p for p in positions if p is not None]
            return text, chat_logprobs(chosen, contexts, self.shown.logprobs, self.text)
        body = completion_logprobs(token_ids, positions, contexts, self.text, self.offset)
        if body["tokens"]:
            self.offset = body["text_offset"][-1] + len(body["tokens"][-1])
        return text, body

    def prompt_logprobs(self, update: Update) -> list[Any] | None:
        if not self.shown.prompt_logprobs or update.prompt_logprobs is None:
            return None
        return prompt_logprobs(update.prompt_logprobs, self.job.prompt, self.text)


def joined(updates: list[Update]) -> Update:
    """A choice's updates as one (the last one's end, the first prompt logprobs)."""
    last = updates[-1]
    logprobs = None
    if any(u.logprobs is not None for u in updates):
        logprobs = [p for u in updates for p in u.logprobs or ()]
    return Update(
        "".join(u.text for u in updates),
        [t for u in updates for t in u.token_ids],
        last.finish_reason,
        last.stop_reason,
        last.request,
        logprobs,
        next((u.prompt_logprobs for u in updates if u.prompt_logprobs is not None), None),
    )


class Answer:
    def __init__(
        self,
        envelope: Envelope,
        prepared: Prepared,
        shown: Shown,
        text: TokenText,
        usage: Callable[[list[Request]], Usage],
    ) -> None:
        self.envelope, self.prepared, self.shown, self.usage = envelope, prepared, shown, usage
        self.jobs = prepared.all_jobs
        n = len(prepared.jobs[0]) if prepared.jobs else 1
        self.views = [
            ChoiceView(envelope, shown, job, prepared.prompt_texts[i // n], text)
            for i, job in enumerate(self.jobs)
        ]

    async def collect(self) -> web.Response:
        choices: list[dict[str, Any]] = []
        finals: list[Request] = []
        prompt_lps: list[Any] | None = None
        for index, (job, view) in enumerate(zip(self.jobs, self.views, strict=True)):
            updates: list[Update] = []
            while not updates or updates[-1].request is None:
                update = await job.updates.get()
                if isinstance(update, Failed):
                    return error_response(failure(update))
                updates.append(update)
            whole = joined(updates)
            assert whole.request is not None
            finals.append(whole.request)
            text, logprobs = view.logprobs(whole)
            lps = view.prompt_logprobs(whole)
            prompt_lps = prompt_lps if prompt_lps is not None else lps
            ids = (job.prompt, whole.token_ids) if self.shown.return_token_ids else None
            forced = self.shown.forced_tool
            calls = None if forced is None else whole_calls(forced, text)
            reason = whole.finish_reason
            if forced is not None:
                reason = finish_reason(forced, reason, calls is not None)
            choices.append(
                self.envelope.choice(
                    index,
                    text,
                    reason,
                    whole.stop_reason,
                    ids,
                    logprobs,
                    None if self.envelope.chat else lps,
                    calls,
                )
            )
        top = prompt_lps if self.envelope.chat else None
        params = next((r.kv_transfer_params for r in finals if r.kv_transfer_params), None)
        return web.json_response(self.envelope.body(choices, self.usage(finals), top, params))

    async def stream(
        self, http: web.Request, deadline: float | None, timed_out: Callable[[], ApiError]
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(http)
        merged: asyncio.Queue[tuple[int, Update | Failed]] = asyncio.Queue()

        async def forward(index: int, job: Job) -> None:
            while True:
                update = await job.updates.get()
                await merged.put((index, update))
                if isinstance(update, Failed) or update.request is not None:
                    return

        tasks = [asyncio.create_task(forward(i, job)) for i, job in enumerate(self.jobs)]
        try:
            async with asyncio.timeout_at(deadline):
                finals = await self._relay(response, merged)
            if finals is not None and self.shown.include_usage:
                await response.write(self.envelope.usage_chunk(self.usage(finals)))
        except TimeoutError:
            await response.write(sse(timed_out().body()))
        finally:
            for t in tasks:
                t.cancel()
        await response.write(DONE)
        await response.write_eof()
        return response

    async def _relay(
        self, response: web.StreamResponse, merged: asyncio.Queue[tuple[int, Update | Failed]]
    ) -> list[Request] | None:
        """Each job's updates as chunks, until all finished (their requests) or one failed
        (None, its error sent)."""
        finals: list[Request | None] = [None] * len(self.jobs)
        started = [False] * len(self.jobs)
        remaining = len(self.jobs)
        while remaining:
            index, update = await merged.get()
            if isinstance(update, Failed):
                await response.write(sse(failure(update).body()))
                return None
            if self._worth_a_chunk(update, started[index]):
                chunk = self._chunk(index, update, first=not started[index])
                if chunk is not None:
                    await response.write(chunk)
                    started[index] = True
            if update.request is not None:
                finals[index] = update.request
                remaining -= 1
        return [r for r in finals if r is not None]

    def _worth_a_chunk(self, update: Update, started: bool) -> bool:
        """Text, tokens the client sees (their logprobs or ids: held-back text still sends
        them, as vLLM does), the first and the last."""
        shows_tokens = self.shown.logprobs is not None or self.shown.return_token_ids
        with_tokens = shows_tokens and bool(update.token_ids)
        return bool(update.text) or with_tokens or not started or update.request is not None

    def _chunk(self, index: int, update: Update, first: bool) -> bytes | None:
        """The update's chunk; None for a tool call's text that completes nothing yet."""
        view = self.views[index]
        text, logprobs = view.logprobs(update)
        ids = (self.jobs[index].prompt, update.token_ids) if self.shown.return_token_ids else None
        reason, calls = update.finish_reason, None
        if view.calls is not None:
            calls = view.calls.feed(text)
            text = ""
            reason = finish_reason(view.calls.forced, reason, view.calls.called)
            if not (calls or first or reason or logprobs or ids):
                return None
        return self.envelope.chunk(
            index,
            text,
            reason,
            update.stop_reason,
            first=first,
            token_ids=ids,
            logprobs=logprobs,
            tool_calls=calls,
        )


def failure(update: Failed, param: str | None = None) -> ApiError:
    if update.status == 400:
        return ApiError(update.message, param)
    return ApiError(update.message, status=update.status, type_="service_unavailable")


__all__ = ["Answer", "ChoiceView", "Shown", "failure", "joined"]
