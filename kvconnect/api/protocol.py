"""The OpenAI API requests kvconnect serves and routes, validated before anything else runs.

    parse(body, CompletionRequest | ChatCompletionRequest) -> the request, or ApiError (400)

Every field is typed (no coercion: "4" and 4.5 are not a max_tokens) and bounded; a bad one is
a 400 whose body is OpenAI's `{"error": {"message", "type", "param", "code"}}` naming it.
Unknown fields are ignored, as OpenAI does; fields kvconnect does not implement (logprobs,
penalties, tools, images...) are refused when set, never silently dropped. The prompt is
checked here for shape; its token ids against the model's vocabulary by the engine.

Shared by `kvconnect serve` and `kvconnect router`, so this imports nothing of the engine.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, TypeVar

import msgspec

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


class _Sampling(msgspec.Struct, kw_only=True):
    """The fields completions and chat completions share."""

    model: str | None = None
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
    cache_salt: Annotated[str, msgspec.Meta(max_length=1024)] | None = None
    return_token_ids: bool = False
    """vLLM's extension: each choice carries its generated `token_ids` and the prompt's
    `prompt_token_ids` (in a stream: the first chunk has the prompt's, each the delta's)."""
    user: str | None = None
    # OpenAI fields kvconnect does not implement: allowed only at their neutral values.
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, Any] | None = None

    def check_unsupported(self) -> None:
        if self.logprobs not in (None, False):
            raise ApiError("logprobs are not supported", "logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ApiError(f"{name} is not supported (only 0)", name)
        if self.logit_bias:
            raise ApiError("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise ApiError("stream_options is only allowed with stream: true", "stream_options")

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
    max_tokens: PositiveTokens = 16
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise ApiError("echo is not supported", "echo")
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
        if all(isinstance(x, str) for x in p):
            prompts: list[str | list[int]] = list(p)
        elif all(_is_token(x) for x in p):
            prompts = [list(p)]
        elif all(isinstance(x, list) and x and all(_is_token(t) for t in x) for x in p):
            prompts = [list(x) for x in p]
        else:
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


class ChatCompletionRequest(_Sampling, kw_only=True):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: PositiveTokens | None = None
    max_completion_tokens: PositiveTokens | None = None
    add_generation_prompt: bool = True
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.top_logprobs is not None:
            raise ApiError("logprobs are not supported", "top_logprobs")
        if self.tools:
            raise ApiError("tools are not supported", "tools")
        if self.tool_choice not in (None, "none"):
            raise ApiError("tool_choice is not supported", "tool_choice")
        if self.response_format not in (None, {"type": "text"}):
            raise ApiError("response_format other than text is not supported", "response_format")
        for i, m in enumerate(self.messages):
            if m.role not in ROLES:
                raise ApiError(
                    f"messages[{i}].role={m.role!r}: must be one of {', '.join(ROLES)}",
                    f"messages[{i}].role",
                )

    @property
    def completion_tokens(self) -> int | None:
        """The output limit: max_completion_tokens, else max_tokens; None: what fits."""
        return self.max_completion_tokens or self.max_tokens

    def conversation(self) -> list[dict[str, str]]:
        """The messages as a chat template takes them: role and text content."""
        out = []
        for i, m in enumerate(self.messages):
            message = {"role": m.role, "content": m.text(i)}
            if m.name is not None:
                message["name"] = m.name
            out.append(message)
        return out


def _is_token(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**31


_PARAM = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")
R = TypeVar("R", CompletionRequest, ChatCompletionRequest)


def parse(body: bytes, kind: type[R]) -> R:
    """The request in `body`, validated; `ApiError` (400 or 413) naming what is wrong."""
    if len(body) > MAX_BODY_BYTES:
        raise ApiError(
            f"request body of {len(body)} bytes is over the limit of {MAX_BODY_BYTES}",
            status=413,
        )
    try:
        request = msgspec.json.decode(body, type=kind, strict=True)
    except msgspec.ValidationError as e:
        found = _PARAM.search(str(e)) or _MISSING.search(str(e))
        param = found.group(1) if found else None
        message = str(e).replace("`$.", "`").replace("`$`", "the body")
        raise ApiError(f"invalid request: {message}", param or None) from None
    except msgspec.DecodeError as e:
        raise ApiError(f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError("the body is nested too deeply") from None
    request.check_unsupported()
    return request


__all__ = [
    "MAX_BODY_BYTES",
    "ApiError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "parse",
]
