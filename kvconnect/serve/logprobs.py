"""The engine's logprobs in OpenAI's shapes, as vLLM's server writes them.

    completions  {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}
    chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{token, ...}]}]}
    prompt       vLLM's `prompt_logprobs`: [None, {"<id>": {"logprob", "rank", "decoded_token"}}]

A position's entries are vLLM's: the token there (with its rank) first, then the k most
likely (ranks 1..k), each token once. A completion's `top_logprobs` keeps them all (k or
k + 1, as OpenAI's API says); a chat token's `top_logprobs` the first k. Tokens are shown as
their own decoded text (special tokens too), logprobs no lower than -9999 (JSON has no -inf).
The logprobs are the model's raw ones: log_softmax before temperature, penalties and biases
(vLLM's default `logprobs_mode`).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from kvconnect.messages import PositionLogprobs
from kvconnect.tokenizer import HFTokenizer, Tokenizer

FLOOR = -9999.0
"""The lowest logprob written: vLLM's (and OpenAI's) stand-in for -inf."""


class TokenText:
    """Each token id's text, as vLLM decodes a logprob's token (alone, specials kept)."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self.of = lru_cache(maxsize=1 << 16)(self._decode)

    def _decode(self, token_id: int) -> str:
        if isinstance(self._tok, HFTokenizer):
            # `Tokenizer.decode` drops special tokens (for generated text): decode underneath.
            return str(self._tok._tok.decode([token_id], skip_special_tokens=False))
        return self._tok.decode([token_id])


def _entries(p: PositionLogprobs) -> dict[int, tuple[float, int]]:
    """token id -> (logprob, rank): the position's token first, then its top alternatives."""
    out = {p.token_id: (max(p.logprob, FLOOR), p.rank)}
    for rank, (t, lp) in enumerate(zip(p.top_token_ids, p.top_logprobs, strict=True), 1):
        out.setdefault(t, (max(lp, FLOOR), rank))
    return out


def completion_logprobs(
    token_ids: list[int],
    positions: list[PositionLogprobs | None],
    text: TokenText,
    offset: int = 0,
) -> dict[str, Any]:
    """OpenAI's completion `logprobs` of `token_ids` (a None position: a prompt's first
    token, which has none); `text_offset` counts from `offset`, token text by token text."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, p in zip(token_ids, positions, strict=True):
        token = text.of(token_id)
        offsets.append(offset)
        offset += len(token)
        tokens.append(token)
        if p is None:
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(max(p.logprob, FLOOR))
        tops.append({text.of(t): lp for t, (lp, _) in _entries(p).items()})
    return {
        "text_offset": offsets,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": tops,
    }


def chat_logprobs(
    positions: list[PositionLogprobs], num_top: int, text: TokenText
) -> dict[str, Any]:
    """OpenAI's chat `logprobs` of the positions' tokens, `num_top` alternatives each."""
    content = []
    for p in positions:
        top = list(_entries(p).items())[:num_top]
        content.append(
            {
                **_chat_token(text.of(p.token_id), p.logprob),
                "top_logprobs": [_chat_token(text.of(t), lp) for t, (lp, _) in top],
            }
        )
    return {"content": content}


def _chat_token(token: str, logprob: float) -> dict[str, Any]:
    return {
        "token": token,
        "logprob": max(logprob, FLOOR),
        "bytes": list(token.encode("utf-8", errors="replace")),
    }


def prompt_logprobs(
    positions: list[PositionLogprobs | None], text: TokenText
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or its entries by id."""
    return [
        None
        if p is None
        else {
            str(t): {"logprob": lp, "rank": rank, "decoded_token": text.of(t)}
            for t, (lp, rank) in _entries(p).items()
        }
        for p in positions
    ]


__all__ = ["TokenText", "chat_logprobs", "completion_logprobs", "prompt_logprobs"]
