"""serve/logprobs.py alone: token texts as vLLM shows them, and the same answer whether a
choice's tokens come in one delta or one by one."""

from __future__ import annotations

from kvconnect.messages import PositionLogprobs
from kvconnect.model.tokenizer import ByteTokenizer
from kvconnect.serve.logprobs import (
    TokenText,
    completion_logprobs,
    output_contexts,
    prompt_contexts,
)

TEXT = TokenText(ByteTokenizer())


def test_an_incomplete_character_is_empty_and_the_byte_that_completes_it_shows_it() -> None:
    euro = list("€".encode())  # E2 82 AC
    assert [TEXT.at(t, euro[:i]) for i, t in enumerate(euro)] == ["", "", "€"]
    assert TEXT.at(euro[2], []) == ""  # no context: vLLM shows ""
    assert TEXT.at(ord("a"), euro[:2]) == "a"  # a complete token is itself
    assert TEXT.at(0xA9, [ord("x"), 0xC3]) == "é"  # the fewest tokens before it that complete it


def test_contexts_run_on_across_deltas_and_skip_the_prompts_first_token() -> None:
    ids = list("a€b".encode())
    whole = output_contexts([], ids)
    assert whole == [ids[max(0, i - 4) : i] for i in range(len(ids))]
    one_by_one = [output_contexts(ids[:i], [t])[0] for i, t in enumerate(ids)]
    assert one_by_one == whole
    assert prompt_contexts(ids) == [[], [], ids[1:2], ids[1:3], ids[1:4]]


def test_one_delta_or_many_give_the_same_logprobs() -> None:
    ids = list("x€y".encode())
    positions = [PositionLogprobs(t, -1.0 - i, 1, (t,), (-1.0 - i,)) for i, t in enumerate(ids)]
    whole = completion_logprobs(ids, list(positions), output_contexts([], ids), TEXT)
    assert whole["tokens"] == ["x", "", "", "€", "y"]
    assert whole["text_offset"] == [0, 1, 1, 1, 2]
    parts, offset = [], 0
    for i, t in enumerate(ids):
        part = completion_logprobs([t], [positions[i]], output_contexts(ids[:i], [t]), TEXT, offset)
        offset = part["text_offset"][-1] + len(part["tokens"][-1])
        parts.append(part)
    for key in whole:
        assert [x for part in parts for x in part[key]] == whole[key]
