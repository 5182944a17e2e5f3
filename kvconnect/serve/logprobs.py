"""The engine's logprobs in OpenAI's shapes, as vLLM's server writes them.

    completions  {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}
    chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{token, ...}]}]}
    prompt       vLLM's `prompt_logprobs`: [None, {"<id>": {"logprob", "rank", "decoded_token"}}]

A position's entries are vLLM's: the token there (with its rank) first, then the k most
likely (ranks 1..k), each token once. A completion's `top_logprobs` keeps them all (k or
k + 1, as OpenAI's API says; two tokens of the same text share one key, the later value); a
chat token's `top_logprobs` the first k. Logprobs are no lower than -9999 (JSON has no -inf).
They are the model's raw ones: log_softmax before temperature, penalties and biases (vLLM's
default `logprobs_mode`).

A token's text is its own decoding (special tokens kept), unless that ends in an incomplete
UTF-8 character: then, as vLLM, it is decoded after the tokens before it at that position (at
most `CONTEXT`: the output's for an output position, the prompt's from its second token for a
prompt position), and shows the character it completes, or "" if it completes none:

    "é" as bytes C3 A9:   C3 -> ""   A9 -> "é"   (so the tokens join to the text)
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from kvconnect.messages import PositionLogprobs
from kvconnect.model.tokenizer import HFTokenizer, Tokenizer

FLOOR = -9999.0
"""The lowest logprob written: vLLM's (and OpenAI's) stand-in for -inf."""
CONTEXT = 4
"""Tokens before a position that its tokens' text may be decoded with (a UTF-8 character is
at most 4 bytes)."""
INCOMPLETE = "\ufffd"


class TokenText:
    """Token ids' text as vLLM shows them in logprobs."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self.of = lru_cache(maxsize=1 << 16)(lambda token_id: self._text((token_id,)))
        """A token's text alone."""
        self._completed = lru_cache(maxsize=1 << 16)(self._complete)

    def _text(self, ids: Sequence[int]) -> str:
        if isinstance(self._tok, HFTokenizer):
            # `Tokenizer.decode` drops special tokens (for generated text): decode underneath.
            return str(self._tok._tok.decode(list(ids), skip_special_tokens=False))
        return self._tok.decode(list(ids))

    def at(self, token_id: int, context: Sequence[int]) -> str:
        """The token's text after `context`, the tokens before its position."""
        alone = self.of(token_id)
        if not alone.endswith(INCOMPLETE):
            return alone
        return self._completed(token_id, tuple(context[-CONTEXT:]))

    def _complete(self, token_id: int, context: tuple[int, ...]) -> str:
        """The text `token_id` adds after the fewest tokens of `context` with which it ends a
        character: what follows the context's text up to its own incomplete tail; "" if none."""
        for n in range(1, len(context) + 1):
            before = context[-n:]
            whole = self._text((*before, token_id))
            if whole.endswith(INCOMPLETE):
                continue
            clean = len(before)
            while clean and self.of(before[clean - 1]).endswith(INCOMPLETE):
                clean -= 1
            prefix = self._text(before[:clean]) if clean else ""
            return whole[_common_prefix(prefix, whole) :]
        return ""


def _common_prefix(a: str, b: str) -> int:
    """Characters `a` and `b` share from the start (a tokenizer may normalise the context's
    text differently alone)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def prompt_contexts(prompt: Sequence[int]) -> list[Sequence[int]]:
    """Each prompt position's context: the tokens before it from the second on (the first has
    no logprobs, and vLLM takes context from the positions that have)."""
    return [prompt[max(1, i - CONTEXT) : i] for i in range(len(prompt))]


def output_contexts(before: Sequence[int], token_ids: Sequence[int]) -> list[Sequence[int]]:
    """Each of `token_ids`' context: the output tokens before it (`before`: earlier deltas')."""
    ids = [*before[-CONTEXT:], *token_ids]
    start = len(ids) - len(token_ids)
    return [ids[max(0, i - CONTEXT) : i] for i in range(start, len(ids))]


def _entries(p: PositionLogprobs) -> dict[int, tuple[float, int]]:
    """token id -> (logprob, rank): the position's token first, then its top alternatives."""
    out = {p.token_id: (max(p.logprob, FLOOR), p.rank)}
    for rank, (t, lp) in enumerate(zip(p.top_token_ids, p.top_logprobs, strict=True), 1):
        out.setdefault(t, (max(lp, FLOOR), rank))
    return out


def completion_logprobs(
    token_ids: list[int],
    positions: list[PositionLogprobs | None],
    contexts: list[Sequence[int]],
    text: TokenText,
    offset: int = 0,
) -> dict[str, Any]:
    """OpenAI's completion `logprobs` of `token_ids` (a None position: a prompt's first
    token, which has none); `text_offset` counts from `offset`, token text by token text."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, p, context in zip(token_ids, positions, contexts, strict=True):
        token = text.of(token_id) if p is None else text.at(token_id, context)
        offsets.append(offset)
        offset += len(token)
        tokens.append(token)
        if p is None:
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(max(p.logprob, FLOOR))
        tops.append({text.at(t, context): lp for t, (lp, _) in _entries(p).items()})
    return {
        "text_offset": offsets,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": tops,
    }


def chat_logprobs(
    positions: list[PositionLogprobs],
    contexts: list[Sequence[int]],
    num_top: int,
    text: TokenText,
) -> dict[str, Any]:
    """OpenAI's chat `logprobs` of the positions' tokens, `num_top` alternatives each."""
    content = []
    for p, context in zip(positions, contexts, strict=True):
        top = list(_entries(p).items())[:num_top]
        content.append(
            {
                **_chat_token(text.at(p.token_id, context), p.logprob),
                "top_logprobs": [_chat_token(text.at(t, context), lp) for t, (lp, _) in top],
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
    positions: list[PositionLogprobs | None], prompt: Sequence[int], text: TokenText
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or its entries by id."""
    return [
        None
        if p is None
        else {
            str(t): {"logprob": lp, "rank": rank, "decoded_token": text.at(t, context)}
            for t, (lp, rank) in _entries(p).items()
        }
        for p, context in zip(positions, prompt_contexts(prompt), strict=True)
    ]


__all__ = [
    "TokenText",
    "chat_logprobs",
    "completion_logprobs",
    "output_contexts",
    "prompt_contexts",
    "prompt_logprobs",
]
