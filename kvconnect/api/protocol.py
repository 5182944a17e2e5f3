"""The OpenAI API requests kvconnect serves and routes, validated before anything else runs.

    parse(body, CompletionRequest | ChatCompletionRequest) -> the request, or ApiError (400)
    (vLLM's /tokenize and /detokenize requests: api/tokenize.py)

Every field is typed (no coercion: "4" and 4.5 are not a max_tokens) and bounded; a bad one is
a 400 whose body is OpenAI's `{"error": {"message", "type", "param", "code"}}` naming it.
Unknown fields are ignored, as OpenAI does; fields kvconnect does not implement (images,
tool_choice "auto", ...) are refused when set, never silently dropped. Structured output and
tools are read by `api/structured.py` into the request's one grammar. Sampling controls
and logprobs take vLLM's names and bounds (`logprobs` and `top_logprobs` up to vLLM's 20, not
OpenAI's 5; `logit_bias` values clamped to [-100, 100]); the engine's `SamplingParams` checks
them again, and the server names the request's field when it refuses one. The prompt is
checked here for shape; its token ids against the model's vocabulary by the engine.

Shared by `kvconnect serve` and `kvconnect router`, so this imports nothing of the engine.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import msgspec

from kvconnect import transfer_params
from kvconnect.api.structured import (
    GrammarSpec,
    NamedToolChoice,
    ResponseFormat,
    SpecError,
    StructuredOutputs,
    ToolChoice,
    Tools,
    grammar_spec,
)
from kvconnect.transfer_params import KVTransferParams

MAX_BODY_BYTES = 4 << 20
"""Larger bodies get 413 before they are parsed."""
MAX_PROMPTS = 64
MAX_N = 16
MAX_STOPS = 16
MAX_TOKENS_LIMIT = 1 << 20
MAX_MESSAGES = 1024

PositiveTokens = Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS_LIMIT)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, msgspec.Meta(ge=-1, le=1 << 20)]
N = Annotated[int, msgspec.Meta(ge=1, le=MAX_N)]
Seed = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
Stop = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
MAX_LOGPROBS = 20
"""vLLM's default `max_logprobs`."""
MAX_LOGIT_BIAS = 1 << 16
MAX_BAD_WORDS = 1024
NumLogprobs = Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
FLOAT32_MAX = 3.4028234663852886e38
RepetitionPenalty = Annotated[float, msgspec.Meta(gt=0.0, le=FLOAT32_MAX)]
"""> 0 as vLLM, and within float32 (the sampler's logits): 1e300 is no stronger than 1e38."""
MinP = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
MinTokens = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS_LIMIT)]
LogitBias = Annotated[dict[str, float], msgspec.Meta(max_length=MAX_LOGIT_BIAS)]
BadWord = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
BIAS_LIMIT = 100.0
"""OpenAI's range of a logit_bias value; vLLM clamps to it rather than refusing."""


class ApiError(Exception):
    """An error for the client, as OpenAI writes one."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = (
            message,
            param,
            status,
            type_,
            code,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class BaseRequest(msgspec.Struct, kw_only=True):
    """What every request shares: the model it is for (None: the one served)."""

    model: str | None = None

    def check_unsupported(self) -> None:
        """`ApiError` if a field kvconnect does not implement is set (types are checked by then)."""


class _Sampling(BaseRequest, kw_only=True):
    """The fields completions and chat completions share."""

    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    n: N = 1
    stop: Stop | Annotated[list[Stop], msgspec.Meta(max_length=MAX_STOPS)] | None = None
    stop_token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_STOPS)] | None = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    cache_salt: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)] | None = None
    """Non-empty when given: an empty salt would silently mean no salt (vLLM refuses it too)."""
    return_token_ids: bool = False
    """vLLM's extension: each choice carries its generated `token_ids` and the prompt's
    `prompt_token_ids` (in a stream: the first chunk has the prompt's, each the delta's)."""
    user: str | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    """Token id (a decimal string, as OpenAI) -> bias added to its logit, clamped to
    [-100, 100]."""
    # vLLM's extensions
    repetition_penalty: RepetitionPenalty | None = None
    min_p: MinP | None = None
    min_tokens: MinTokens = 0
    bad_words: Annotated[list[BadWord], msgspec.Meta(max_length=MAX_BAD_WORDS)] | None = None
    prompt_logprobs: NumLogprobs | None = None
    """vLLM's: each prompt token's logprob (the first null) with this many alternatives; not
    with stream (vLLM refuses them there too, unless 0)."""
    response_format: ResponseFormat | None = None
    """OpenAI's: json_object or json_schema (vLLM takes it on completions too)."""
    structured_outputs: StructuredOutputs | None = None
    """vLLM's: json, json_object, regex, choice or grammar."""
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's: per-request instructions for the KV connector (a peer to pull from, P/D), the
    keys of `kvconnect.transfer_params` only (an unknown one is a 400, not ignored)."""

    def transfer_params(self) -> dict[str, Any] | None:
        """`kv_transfer_params` as the engine's connector reads it (None: none given)."""
        return self.kv_transfer_params or None

    def wants_prompt_logprobs(self) -> bool:
        """Whether the answer carries the prompt's logprobs: the engine then computes the whole
        prompt and reads no cached prefix (vLLM skips its prefix cache for them too)."""
        return self.prompt_logprobs is not None

    def transfer(self) -> KVTransferParams | None:
        """`kv_transfer_params` checked (`ApiError` naming the key that is wrong)."""
        if self.kv_transfer_params is None:
            return None
        try:
            return transfer_params.parse(self.kv_transfer_params)
        except ValueError as e:
            raise ApiError(str(e), "kv_transfer_params") from None

    def check_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ApiError("stream_options is only allowed with stream: true", "stream_options")
        if self.stream and self.prompt_logprobs:
            raise ApiError("prompt_logprobs are not available with stream: true", "prompt_logprobs")
        self.token_biases()
        self.grammar()
        self.transfer()

    def grammar(self) -> GrammarSpec | None:
        """The one grammar the output follows, if any (`ApiError` naming the field if the
        request asks for two)."""
        try:
            return grammar_spec(self.response_format, self.structured_outputs)
        except SpecError as e:
            raise ApiError(str(e), e.param) from None

    def token_biases(self) -> dict[int, float] | None:
        """`logit_bias` with token ids for keys and values clamped, as vLLM reads it."""
        if not self.logit_bias:
            return None
        bad = [k for k in self.logit_bias if not (k.isascii() and k.isdigit())]
        if bad:
            raise ApiError(
                f"logit_bias: keys must be token ids (decimal strings), not {bad[:3]!r}",
                "logit_bias",
            )
        return {int(k): min(BIAS_LIMIT, max(-BIAS_LIMIT, v)) for k, v in self.logit_bias.items()}

    @property
    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling, kw_only=True):
    """POST /v1/completions."""

    prompt: Any
    max_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS_LIMIT)] = 16
    """0 only with echo (vLLM's): the answer is the prompt alone (scoring it by its logprobs)."""
    echo: bool = False
    """The prompt before each choice's text (and its tokens' logprobs before the output's)."""
    logprobs: NumLogprobs | None = None
    """Each output token's logprob, with this many most likely alternatives."""
    best_of: int | None = None
    suffix: str | None = None

    def wants_prompt_logprobs(self) -> bool:
        return super().wants_prompt_logprobs() or (self.echo and self.logprobs is not None)

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.max_tokens == 0 and not self.echo:
            raise ApiError("max_tokens must be at least 1 (0 only with echo)", "max_tokens")
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError("best_of other than n is not supported", "best_of")
        if self.suffix:
            raise ApiError("suffix is not supported", "suffix")

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or token ids: OpenAI's four shapes of `prompt`."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not isinstance(p, list) or not p:
            raise ApiError(
                "prompt must be a string, a list of strings, a list of token ids, or a list of "
                "lists of token ids",
                "prompt",
            )
        prompts: list[str | list[int]] | None = None
        if all(isinstance(x, str) for x in p):
            prompts = list(p)
        elif (ids := _token_ids(p)) is not None:
            prompts = [ids]
        elif all(isinstance(x, list) for x in p):
            lists = [_token_ids(x) for x in p]
            prompts = None if None in lists else lists  # type: ignore[assignment]
        if prompts is None:
            raise ApiError(
                "prompt: a list must hold only strings, only token ids (integers >= 0), or "
                "only non-empty lists of token ids",
                "prompt",
            )
        if len(prompts) * self.n > MAX_PROMPTS * MAX_N or len(prompts) > MAX_PROMPTS:
            raise ApiError(f"at most {MAX_PROMPTS} prompts in one request", "prompt")
        return prompts


class TextPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    """An assistant's calls, handed to the chat template as given."""
    tool_call_id: str | None = None
    """A tool message's answer to that call."""

    def text(self, index: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ApiError(
                    f"messages[{index}].content: only text parts are supported, not {part.type!r}",
                    f"messages[{index}].content",
                )
            parts.append(part.text)
        return "".join(parts)


ROLES = ("system", "developer", "user", "assistant", "tool")
Messages = Annotated[list[ChatMessage], msgspec.Meta(min_length=1, max_length=MAX_MESSAGES)]


class ChatCompletionRequest(_Sampling, kw_only=True):
    """POST /v1/chat/completions."""

    messages: Messages
    max_tokens: PositiveTokens | None = None
    max_completion_tokens: PositiveTokens | None = None
    add_generation_prompt: bool = True
    logprobs: bool | None = False
    top_logprobs: NumLogprobs | None = None
    """With `logprobs`: this many most likely alternatives of each token."""
    tools: Tools | None = None
    """Function tools, handed to the chat template; called as `tool_choice` says."""
    tool_choice: ToolChoice | None = None
    """"required" or a named function: the output is a call, valid JSON for the parameters
    (through the grammar). "none": no call. "auto" needs a tool call parser, which
    kvconnect does not have: refused (vLLM refuses it without --tool-call-parser)."""

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.top_logprobs and not self.logprobs:
            raise ApiError("top_logprobs needs logprobs: true", "top_logprobs")
        self._check_tools()
        check_roles(self.messages)

    def _check_tools(self) -> None:
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ApiError("tool_choice needs tools", "tool_choice")
        if self.tools and self.tool_choice in (None, "auto"):
            raise ApiError(
                'tool_choice "auto" (the default with tools) needs a tool call parser, which '
                'this server does not have: give "required", a named function or "none"',
                "tool_choice",
            )

    def grammar(self) -> GrammarSpec | None:
        try:
            return grammar_spec(
                self.response_format, self.structured_outputs, self.tools, self.tool_choice
            )
        except SpecError as e:
            raise ApiError(str(e), e.param) from None

    @property
    def forced_tool(self) -> str | None:
        """The function the answer must call ("" for any of the tools: "required"); None
        when the answer is text."""
        if not self.tools:
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return "" if self.tool_choice == "required" else None

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as a chat template takes them."""
        return msgspec.to_builtins(self.tools) if self.tools else None

    @property
    def completion_tokens(self) -> int | None:
        """The output limit: max_completion_tokens, else max_tokens; None: what fits."""
        return self.max_completion_tokens or self.max_tokens

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as a chat template takes them: role and text content."""
        return as_conversation(self.messages)


def check_roles(messages: list[ChatMessage]) -> None:
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise ApiError(
                f"messages[{i}].role={m.role!r}: must be one of {', '.join(ROLES)}",
                f"messages[{i}].role",
            )


def as_conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(messages):
        message: dict[str, Any] = {"role": m.role, "content": m.text(i)}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls is not None:
            message["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


_TokenIds = list[Annotated[int, msgspec.Meta(ge=0, lt=2**31)]]


def _token_ids(x: list[Any]) -> list[int] | None:
    """`x` as token ids (a new list), or None unless it is a non-empty list of integers
    0 <= id < 2**31 (bools are not integers here). Checked in C: a long prompt is one call."""
    if not x:
        return None
    try:
        ids: list[int] = msgspec.convert(x, _TokenIds, strict=True)
    except msgspec.ValidationError:
        return None
    return ids


_PARAM = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")
R = TypeVar("R", bound=BaseRequest)


def parse(body: bytes, kind: type[R]) -> R:
    """The request in `body`, validated; `ApiError` (400 or 413) naming what is wrong."""
    check_size(body)
    request = validated(lambda: msgspec.json.decode(body, type=kind, strict=True))
    request.check_unsupported()
    return request


def check_size(body: bytes) -> None:
    if len(body) > MAX_BODY_BYTES:
        raise ApiError(
            f"request body of {len(body)} bytes is over the limit of {MAX_BODY_BYTES}",
            status=413,
        )


T = TypeVar("T")


def validated(decode: Callable[[], T]) -> T:
    """`decode()`, its failures as the 400 that names the field."""
    try:
        return decode()
    except msgspec.ValidationError as e:
        found = _PARAM.search(str(e)) or _MISSING.search(str(e))
        param = found.group(1).removesuffix("[...]") if found else None
        message = str(e).replace("`$.", "`").replace("`$`", "the body")
        raise ApiError(f"invalid request: {message}", param or None) from None
    except msgspec.DecodeError as e:
        raise ApiError(f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError("the body is nested too deeply") from None


__all__ = [
    "MAX_BODY_BYTES",
    "ApiError",
    "BaseRequest",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "Messages",
    "as_conversation",
    "check_roles",
    "check_size",
    "parse",
    "validated",
]
