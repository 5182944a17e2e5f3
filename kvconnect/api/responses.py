"""OpenAI's response bodies and stream chunks, as the OpenAI Python client reads them.

    completion       {"id": "cmpl-..", "object": "text_completion", "choices": [{"index",
                      "text", "logprobs", "finish_reason", "stop_reason"}], "usage"}
    chat completion  {"id": "chatcmpl-..", "object": "chat.completion", "choices": [{"index",
                      "message": {"role", "content", "tool_calls"?}, "logprobs",
                      "finish_reason", ...}], "usage"}

`logprobs` come built (serve/logprobs.py: OpenAI's shapes); null when not asked for.
    stream           "data: <chunk>\\n\\n" ... then "data: [DONE]\\n\\n"; with
                      stream_options.include_usage a last chunk with no choices and the usage

`usage.prompt_tokens_details.cached_tokens` counts the prompt tokens the engine did not compute:
found in its prefix cache or loaded by its KV connector. It is there only when the server was
asked for it (`--enable-prompt-tokens-details`, as vLLM): it tells a client which prefixes
other clients sent, on this instance or (through a shared tier) on any.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

TokenIds = tuple[list[int], list[int]]
"""(prompt token ids, generated token ids) of one choice, with `return_token_ids`."""


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None
    """None: `prompt_tokens_details` left out."""
    cached_tokens_by_source: dict[str, int] | None = None
    """`cached_tokens` by where they came from (vLLM's sources: device, host, p2p, disk,
    external_unspecified; non-zero ones only), beside it in `prompt_tokens_details`."""

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if self.cached_tokens is not None:
            details: dict[str, Any] = {"cached_tokens": self.cached_tokens}
            if self.cached_tokens_by_source is not None:
                details["cached_tokens_by_source"] = self.cached_tokens_by_source
            body["prompt_tokens_details"] = details
        return body


@dataclass
class Envelope:
    """What every body and chunk of one response shares."""

    chat: bool
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        stop_reason: str | int | None = None,
        token_ids: TokenIds | None = None,
        logprobs: dict[str, Any] | None = None,
        prompt_logprobs: list[Any] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """One choice of a whole answer; `prompt_logprobs` (vLLM's) only in a completion's;
        a chat message with `tool_calls` has empty content (as vLLM answers)."""
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if tool_calls is not None:
                message = {"role": "assistant", "content": "", "tool_calls": tool_calls}
            choice: dict[str, Any] = {
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
        else:
            choice = {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
            if prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs
        if token_ids is not None:
            choice["prompt_token_ids"], choice["token_ids"] = token_ids
        return choice

    def body(
        self,
        choices: list[dict[str, Any]],
        usage: Usage,
        prompt_logprobs: list[Any] | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The whole answer; a chat's `prompt_logprobs` (vLLM's) are the answer's own, and
        so are the connector's `kv_transfer_params` (a P/D prefill's: where its KV is)."""
        obj = "chat.completion" if self.chat else "text_completion"
        body = {**self._head(obj), "choices": choices, "usage": usage.body()}
        if prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        return body

    def chunk(
        self,
        index: int,
        text: str | None,
        finish_reason: str | None = None,
        stop_reason: str | int | None = None,
        first: bool = False,
        token_ids: TokenIds | None = None,
        logprobs: dict[str, Any] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> bytes:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs}
        choice["finish_reason"] = finish_reason
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        if token_ids is not None:
            prompt, delta_ids = token_ids
            if first:
                choice["prompt_token_ids"] = prompt
            choice["token_ids"] = delta_ids
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse({**self._head(obj), "choices": [choice]})

    def usage_chunk(self, usage: Usage) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse({**self._head(obj), "choices": [], "usage": usage.body()})


def sse(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


DONE = b"data: [DONE]\n\n"
