"""A validated completion or chat request turned into engine jobs: prompts tokenized (a chat
rendered with the model's template), one `SamplingParams` per choice.

    prepare(req, info, loop) -> Prepared   (ApiError naming the request's field if not)

The engine's `SamplingParams` checks every control again and names its own field
(`SamplingParams.bad_words_token_ids=...`); such a refusal is answered here, with the field of
the request it came from (`bad_words`), before any job reaches the engine. Token ids are
checked against the vocabulary here too, for the same reason.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from kvconnect.api.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from kvconnect.engine.llm import EngineInfo
from kvconnect.engine.request import SamplingParams, bad_words_token_ids
from kvconnect.serve.engine_loop import Job
from kvconnect.tokenizer import ChatTemplateError, Tokenizer

GenerateRequest = CompletionRequest | ChatCompletionRequest


@dataclass
class Prepared:
    """A validated request turned into engine jobs."""

    prompts: list[list[int]]
    jobs: list[list[Job]]  # per prompt, its n choices
    param: str
    """The request field the prompts came from, named in a refusal."""
    prompt_texts: list[str]
    """Each prompt as text: what `echo` puts before a choice's output."""

    @property
    def all_jobs(self) -> list[Job]:
        return [job for choices in self.jobs for job in choices]


def prepare(req: GenerateRequest, info: EngineInfo, loop: asyncio.AbstractEventLoop) -> Prepared:
    """Tokenize and build the jobs; the engine checks the prompts when it takes them. Runs on a
    worker thread: a huge prompt must not stall the event loop."""
    tok = info.tokenizer
    if isinstance(req, ChatCompletionRequest):
        texts = [render(tok, req.conversation(), req.add_generation_prompt)]
        prompts, param = [tok.encode(texts[0])], "messages"
    else:
        given = req.prompts()
        prompts = [p if isinstance(p, list) else tok.encode(p) for p in given]
        texts = [tok.decode(p) if isinstance(p, list) else p for p in given]
        param = "prompt"
    words = _bad_words(req, tok)
    jobs = []
    for tokens in prompts:
        max_tokens = _max_tokens(req, info.max_model_len, len(tokens))
        choices = []
        for j in range(req.n):
            params = _checked(req, info, partial(sampling_params, req, max_tokens, j, words))
            choices.append(Job(tokens, params, loop, cache_salt=req.cache_salt))
        jobs.append(choices)
    return Prepared(prompts, jobs, param, texts)


def render(
    tok: Tokenizer,
    conversation: list[dict[str, str]],
    add_generation_prompt: bool,
    continue_final_message: bool = False,
) -> str:
    """The chat as the model's template renders it; `ApiError` naming `messages` if not."""
    try:
        text = tok.apply_chat_template(conversation, add_generation_prompt)
    except ChatTemplateError as e:
        raise ApiError(str(e), "messages") from None
    if continue_final_message:
        return _continue_final(text, conversation[-1]["content"])
    return text


def _max_tokens(req: GenerateRequest, max_model_len: int, num_prompt: int) -> int:
    if isinstance(req, ChatCompletionRequest):
        given = req.completion_tokens
        return given if given is not None else max(1, max_model_len - num_prompt)
    return req.max_tokens or 1  # echo alone (0): one token is run and not shown, as in vLLM


def num_logprobs(req: GenerateRequest) -> int | None:
    """Alternatives per output token the answer shows; None: no logprobs."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def num_prompt_logprobs(req: GenerateRequest) -> int | None:
    """Alternatives per prompt token: vLLM's `prompt_logprobs`, else (echo with logprobs) as
    many as the output's."""
    if req.prompt_logprobs is not None:
        return req.prompt_logprobs
    echo = isinstance(req, CompletionRequest) and req.echo
    return num_logprobs(req) if echo else None


def sampling_params(
    req: GenerateRequest, max_tokens: int, j: int, bad_words: tuple[tuple[int, ...], ...]
) -> SamplingParams:
    """Choice `j`'s sampling (seed s gives choices s, s+1, ...), with vLLM's defaults for
    what the request leaves out."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k in (None, -1) else req.top_k,
        seed=None if req.seed is None else (req.seed + j) % 2**63,
        stop=req.stops,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        min_p=req.min_p or 0.0,
        min_tokens=req.min_tokens,
        logit_bias=req.token_biases(),
        bad_words_token_ids=bad_words,
        logprobs=num_logprobs(req),
        prompt_logprobs=num_prompt_logprobs(req),
    )


def _bad_words(req: GenerateRequest, tok: Tokenizer) -> tuple[tuple[int, ...], ...]:
    try:
        return bad_words_token_ids(req.bad_words or (), tok)
    except ValueError as e:
        raise ApiError(str(e), "bad_words") from None


_FIELD = re.compile(r"^SamplingParams\.(\w+)")


def _checked(
    req: GenerateRequest, info: EngineInfo, build: Callable[[], SamplingParams]
) -> SamplingParams:
    """`build()`, checked against the vocabulary; a refusal as the 400 naming the request's
    field (the engine's message names its own)."""
    try:
        params = build()
        params.check_token_ids(info.vocab_size)
    except ValueError as e:
        found = _FIELD.match(str(e))
        name = found.group(1) if found else None
        field = _request_field(req, name)
        raise ApiError(_FIELD.sub(field or "", str(e)), field) from None
    return params


def _request_field(req: GenerateRequest, name: str | None) -> str | None:
    """The request's name for `SamplingParams.<name>`."""
    if name == "bad_words_token_ids":
        return "bad_words"
    if not isinstance(req, ChatCompletionRequest):
        return name
    if name == "logprobs":
        return "top_logprobs"
    if name == "max_tokens":
        return "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    return name


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


__all__ = ["GenerateRequest", "Prepared", "num_logprobs", "prepare", "render"]
