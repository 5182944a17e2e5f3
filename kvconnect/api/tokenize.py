"""vLLM's tokenizer endpoints' requests (vllm/entrypoints/serve/tokenize/protocol.py), validated
as every request is (`api/protocol.py`).

    parse(body, DetokenizeRequest)                           POST /detokenize
    parse_tokenize(body) -> TokenizeCompletionRequest | TokenizeChatRequest
                                                             POST /tokenize, either form
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvconnect.api.protocol import (
    ApiError,
    BaseRequest,
    Messages,
    as_conversation,
    check_roles,
    check_size,
    validated,
)
from kvconnect.api.structured import Tools


class TokenizeCompletionRequest(BaseRequest, kw_only=True):
    """POST /tokenize with a prompt: its token ids as /v1/completions runs them."""

    prompt: str
    add_special_tokens: bool = True
    """vLLM's: add the tokenizer's own special tokens (BOS); kvconnect's add none (the server
    says why)."""
    return_token_strs: bool | None = False
    """Also return each token's piece of the vocabulary."""


class TokenizeChatRequest(BaseRequest, kw_only=True):
    """POST /tokenize with messages: rendered as /v1/chat/completions renders them."""

    messages: Messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """End the prompt inside the final message (no end of turn), for the model to continue it;
    only with add_generation_prompt false."""
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    # vLLM fields kvconnect does not implement: allowed only unset.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    tools: Tools | None = None
    """Handed to the chat template, as chat completions hands them."""

    def check_unsupported(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise ApiError(
                "continue_final_message and add_generation_prompt cannot both be true "
                "(add_generation_prompt is true unless set false)",
                "continue_final_message",
            )
        if self.chat_template is not None:
            raise ApiError("chat_template is not supported (the model's is used)", "chat_template")
        for name in ("chat_template_kwargs", "mm_processor_kwargs"):
            if getattr(self, name):
                raise ApiError(f"{name} is not supported", name)
        check_roles(self.messages)

    def conversation(self) -> list[dict[str, Any]]:
        return as_conversation(self.messages)

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return msgspec.to_builtins(self.tools) if self.tools else None


class DetokenizeRequest(BaseRequest, kw_only=True):
    """POST /detokenize: token ids back to text (the server checks them against the vocabulary)."""

    tokens: list[int]


def parse_tokenize(body: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """A /tokenize request: the chat form when it has `messages`, else the prompt form."""
    check_size(body)
    fields = validated(lambda: msgspec.json.decode(body))
    if not isinstance(fields, dict):
        raise ApiError("invalid request: the body must be a JSON object")
    request: TokenizeCompletionRequest | TokenizeChatRequest
    if "messages" in fields:
        if "prompt" in fields:
            raise ApiError("give `prompt` or `messages`, not both", "prompt")
        request = validated(lambda: msgspec.convert(fields, TokenizeChatRequest, strict=True))
    elif "prompt" in fields:
        request = validated(lambda: msgspec.convert(fields, TokenizeCompletionRequest, strict=True))
    else:
        raise ApiError("the body needs `prompt` (a string) or `messages` (a chat)", "prompt")
    request.check_unsupported()
    return request


__all__ = [
    "DetokenizeRequest",
    "TokenizeChatRequest",
    "TokenizeCompletionRequest",
    "parse_tokenize",
]
