"""A validated completion or chat request turned into engine jobs: prompts tokenized (a chat
rendered with the model's template), one `SamplingParams` per choice.

    prepare(req, info, loop) -> Prepared   (ApiError naming the request's field if not)

The engine's `SamplingParams` checks every control again and names its own field
(`SamplingParams.bad_words_token_ids=...`); such a refusal is answered here, with the field of
the request it came from (`bad_words`), before any job reaches the engine. Token ids are
checked against the vocabulary here too, for the same reason, and a structured-output spec
(a response_format schema, vLLM's structured_outputs, the schema of a forced tool call) is
compiled here with the engine's cached compiler: a bad schema, regex or grammar is a 400
naming its field, and the engine then finds it compiled.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from kvconnect.api.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from kvconnect.api.structured import GrammarSpec
from kvconnect.engine.llm import EngineInfo
from kvconnect.engine.request import SamplingParams, bad_words_token_ids
from kvconnect.engine.structured_output import StructuredOutputsParams
from kvconnect.model.tokenizer import ChatTemplateError, Tokenizer
from kvconnect.serve.engine_loop import Job

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
    forced_tool: str | None = None
    """The function each choice calls ("" for any of the tools); None: the answer is text."""

    @property
    def all_jobs(self) -> list[Job]:
        return [job for choices in self.jobs for job in choices]


def prepare(req: GenerateRequest, info: EngineInfo, loop: asyncio.AbstractEventLoop) -> Prepared:
    """Tokenize and build the jobs; the engine checks the prompts when it takes them. Runs on a
    worker thread: a huge prompt must not stall the event loop."""
    tok = info.tokenizer
    if isinstance(req, ChatCompletionRequest):
        tools = req.tool_dicts()
        texts = [render(tok, req.conversation(), req.add_generation_prompt, tools=tools)]
        prompts, param = [tok.encode(texts[0])], "messages"
    else:
        given = req.prompts()
        prompts = [p if isinstance(p, list) else tok.encode(p) for p in given]
        texts = [tok.decode(p) if isinstance(p, list) else p for p in given]
        param = "prompt"
    words = _bad_words(req, tok)
    grammar = structured_outputs(req.grammar(), info)
    jobs = []
    for tokens in prompts:
        max_tokens = _max_tokens(req, info.max_model_len, len(tokens))
        choices = []
        for j in range(req.n):
            build = partial(sampling_params, req, max_tokens, j, words, grammar)
            choices.append(
                Job(
                    tokens,
                    _checked(req, info, build),
                    loop,
                    cache_salt=req.cache_salt,
                    kv_transfer_params=req.transfer_params(),
                )
            )
        jobs.append(choices)
    forced = req.forced_tool if isinstance(req, ChatCompletionRequest) else None
    return Prepared(prompts, jobs, param, texts, forced)


def structured_outputs(
    spec: GrammarSpec | None, info: EngineInfo
) -> StructuredOutputsParams | None:
    """The engine's spec of the request's grammar, compiled (and so cached) now: `ApiError`
    naming the request's field if it does not compile."""
    if spec is None:
        return None
    value = spec.value
    try:
        params = StructuredOutputsParams(
            json=value if spec.kind == "json" else None,  # type: ignore[arg-type]
            json_object=spec.kind == "json_object",
            regex=value if spec.kind == "regex" else None,  # type: ignore[arg-type]
            choice=value if spec.kind == "choice" else None,  # type: ignore[arg-type]
            grammar=value if spec.kind == "grammar" else None,  # type: ignore[arg-type]
        )
        info.grammars.compile(params)
    except ValueError as e:
        why = str(e).split(": ", 1)[-1]
        raise ApiError(f"{spec.param}: {why}", spec.param) from None
    return params


def render(
    tok: Tokenizer,
    conversation: list[dict[str, Any]],
    add_generation_prompt: bool,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The chat as the model's template renders it (with the tools, if the template shows
    them); `ApiError` naming `messages` if not."""
    try:
        text = tok.apply_chat_template(conversation, add_generation_prompt, tools)
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
    req: GenerateRequest,
    max_tokens: int,
    j: int,
    bad_words: tuple[tuple[int, ...], ...],
    grammar: StructuredOutputsParams | None = None,
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
        structured_outputs=grammar,
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
