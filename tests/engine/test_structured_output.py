"""Structured output's parts without processes: xgrammar's bitmask applied in the batched
sampler (masked tokens are never sampled, whatever their logits), the compiled-grammar LRU,
bad specs refused naming their field, and the token bytes xgrammar matches against."""

from __future__ import annotations

import re

import pytest
import torch
import xgrammar as xgr

from kvconnect.engine.sampler import SamplingBatch, apply_token_bitmask, sample
from kvconnect.engine.structured_output import (
    Grammar,
    GrammarCompiler,
    StructuredOutputsParams,
    grammar_bitmask,
)
from kvconnect.model.tokenizer import BYTE_EOS, ByteTokenizer, load_tokenizer

VOCAB = 258
DIGITS = StructuredOutputsParams(regex=r"[0-9]{2}")


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(ByteTokenizer(), VOCAB)


def batch(rows: int, temperature: float, bitmask: torch.Tensor) -> SamplingBatch:
    return SamplingBatch(
        temperature=torch.full((rows,), temperature),
        top_k=torch.zeros(rows, dtype=torch.long),
        top_p=torch.ones(rows),
        min_p=torch.zeros(rows),
        seeds=list(range(rows)),
        num_logprobs=[2] * rows,
        allowed=(torch.arange(rows), bitmask),
    )


def test_masked_tokens_are_never_sampled_greedy_or_random(compiler: GrammarCompiler) -> None:
    grammar = compiler.matcher(DIGITS)
    mask = grammar_bitmask([("r", grammar)] * 64)
    assert mask is not None and mask.bitmask.shape == (64, (VOCAB + 31) // 32)
    bitmask = torch.from_numpy(mask.bitmask)
    # The digits are the least likely tokens: every other token is far ahead of them.
    logits = torch.full((64, VOCAB), 10.0)
    logits[:, ord("0") : ord("9") + 1] = torch.linspace(-5, -1, 10)
    before = logits.clone()
    for temperature in (0.0, 1.0):
        out = sample(logits, batch(64, temperature, bitmask))
        assert all(ord("0") <= t <= ord("9") for t in out.token_ids)
        if temperature == 0:
            assert set(out.token_ids) == {ord("9")}  # the most likely allowed token
        else:
            assert len(set(out.token_ids)) > 3  # really drawn, among the digits only
        for lp in out.logprobs:  # the mask comes first, as in vLLM: logprobs see it
            assert lp is not None and set(lp.top_token_ids) <= set(range(48, 58))
    assert torch.equal(logits, before)  # the caller's logits are not changed


def test_the_unpacked_bitmask_equals_xgrammars_own_kernel(compiler: GrammarCompiler) -> None:
    anything = StructuredOutputsParams(json_object=True)
    rows = [("a", compiler.matcher(DIGITS)), ("b", compiler.matcher(anything))]
    rows[1][1].accept(ord("{"))
    mask = grammar_bitmask(rows)
    assert mask is not None
    logits = torch.randn(5, VOCAB)
    where = torch.tensor([3, 1])
    ours = apply_token_bitmask(logits, where, torch.from_numpy(mask.bitmask))
    theirs = logits.clone()  # xgrammar's kernel takes a mask per row: the rest allow all
    full = torch.full((5, mask.bitmask.shape[1]), -1, dtype=torch.int32)
    full[where] = torch.from_numpy(mask.bitmask)
    xgr.apply_token_bitmask_inplace(theirs, full)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[[0, 2, 4]], logits[[0, 2, 4]])  # rows without a grammar untouched


def complete_digits(compiler: GrammarCompiler) -> tuple[Grammar, torch.Tensor]:
    """A DIGITS matcher fed "42" (complete: only EOS may follow) and its one-row bitmask."""
    grammar = compiler.matcher(DIGITS)
    for ch in b"42":
        grammar.accept(ch)
        assert not grammar.is_done
    mask = grammar_bitmask([("r", grammar)])
    assert mask is not None
    return grammar, torch.from_numpy(mask.bitmask)


def test_a_grammar_allows_only_eos_once_complete_and_then_terminates(
    compiler: GrammarCompiler,
) -> None:
    grammar, bitmask = complete_digits(compiler)
    allowed = apply_token_bitmask(torch.zeros(1, VOCAB), torch.tensor([0]), bitmask)
    assert torch.isfinite(allowed[0]).nonzero().flatten().tolist() == [BYTE_EOS]
    grammar.accept(BYTE_EOS)
    assert grammar.is_terminated and grammar.is_done
    rejecting = compiler.matcher(DIGITS)
    rejecting.accept(ord("x"))  # a token the mask would have forbidden
    assert rejecting.rejected and rejecting.is_done


def test_compiled_grammars_are_cached_by_spec_least_recently_used_first_out() -> None:
    compiler = GrammarCompiler(ByteTokenizer(), VOCAB, max_cached=2)
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
    first = compiler.compile(a)
    assert compiler.compile(StructuredOutputsParams(regex="a+")) is first  # same spec: a hit
    compiler.compile(b)
    compiler.compile(a)  # a is now the most recently used
    compiler.compile(c)  # evicts b
    assert (compiler.num_hits, compiler.num_misses, compiler.num_cached) == (2, 3, 2)
    assert compiler.compile(a) is first
    compiler.compile(b)
    assert compiler.num_misses == 4
    choice = StructuredOutputsParams(choice=("x", "y"))
    assert choice.key != StructuredOutputsParams(choice=("x, y",)).key


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (StructuredOutputsParams(json='{"type": 5}'), "json"),
        (StructuredOutputsParams(json="{not json"), "json"),
        (StructuredOutputsParams(regex="a("), "regex"),
        (StructuredOutputsParams(grammar="root ::= "), "grammar"),
        (StructuredOutputsParams(grammar='rot ::= "a"'), "grammar"),
    ],
)
def test_a_bad_spec_is_a_value_error_naming_its_field(
    compiler: GrammarCompiler, params: StructuredOutputsParams, field: str
) -> None:
    with pytest.raises(ValueError, match=rf"^structured_outputs\.{field}: \S"):
        compiler.compile(params)


def test_a_spec_sets_exactly_one_field() -> None:
    for bad in ({}, {"regex": "a", "grammar": 'root ::= "a"'}, {"choice": ()}):
        with pytest.raises(ValueError, match="structured_outputs"):
            StructuredOutputsParams(**bad)  # type: ignore[arg-type]


def test_choices_are_escaped_into_the_grammar(compiler: GrammarCompiler) -> None:
    choices = ('say "hi"', "back\\slash", "new\nline", "naïve ☃")
    grammar = compiler.matcher(StructuredOutputsParams(choice=choices))
    for byte in choices[0].encode():
        grammar.accept(byte)
    grammar.accept(BYTE_EOS)
    assert grammar.is_terminated


def test_token_bytes_join_to_the_text_for_byte_level_bpe() -> None:
    tok = load_tokenizer("smollm2")
    pieces = tok.token_bytes()
    text = 'Hé said {"a": [1, 2]}\n\t😀 <|im_end|>'
    ids = tok.encode(text)
    assert b"".join(pieces[i] for i in ids).decode() == tok.decode(ids)
    assert tok.eos_token_id is not None and pieces[tok.eos_token_id] == b""  # special: no text
    assert re.fullmatch(rb" ?the", pieces[tok.encode(" the")[0]])


def test_a_ban_that_leaves_a_grammar_no_token_gives_way_to_the_grammar(
    compiler: GrammarCompiler,
) -> None:
    """min_tokens bans EOS, the only token a complete grammar allows: the grammar wins."""
    _, bitmask = complete_digits(compiler)
    rows = batch(1, 0.0, bitmask)
    rows.banned = (torch.tensor([0]), torch.tensor([BYTE_EOS]))
    assert sample(torch.zeros(1, VOCAB), rows).token_ids == [BYTE_EOS]
    free = batch(1, 0.0, torch.full((1, 9), -1, dtype=torch.int32))  # allows all
    free.banned = (torch.tensor([0]), torch.tensor([0]))
    assert sample(torch.zeros(1, VOCAB), free).token_ids != [0]  # other bans still hold
