"""Structured output's cost per decode step, beside the sampling it constrains (the limit).

Prints one line: for a decode step of 16 requests over SmolLM2's vocabulary (49,152 byte-level
BPE tokens, their bytes from the GGUF), each under a JSON schema advanced a few tokens into
its output, the scheduler's part (xgrammar fills the 16 rows' packed bitmask) and the
sampler's (`apply_token_bitmask`: unpack, -inf on the forbidden tokens), beside a bare
`softmax` + `multinomial` over the same [16, vocab] logits, the least any sampler does. Also
the first compile of the schema (xgrammar builds its tokenizer info then) and a cached one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import torch

from kvconnect.engine.sampler import apply_token_bitmask
from kvconnect.engine.structured_output import (
    GrammarCompiler,
    StructuredOutputsParams,
    grammar_bitmask,
)
from kvconnect.model.tokenizer import load_tokenizer

BATCH = 16
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["city", "days", "tags"],
}
PREFIX = '{"city": "Par'
"""Where each matcher stands: inside a string, where most of the vocabulary is allowed."""


def per_step(fn: Callable[[], object], repeat: int = 30) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def main() -> None:
    torch.set_num_threads(1)
    tok = load_tokenizer("smollm2")
    vocab = 49152
    compiler = GrammarCompiler(tok, vocab)
    params = StructuredOutputsParams(json=json.dumps(SCHEMA))
    start = time.perf_counter()
    compiler.compile(params)
    first_ms = (time.perf_counter() - start) * 1e3
    cached_ms = per_step(lambda: compiler.compile(params), repeat=100)
    grammars = [compiler.matcher(params) for _ in range(BATCH)]
    for grammar in grammars:
        for token in tok.encode(PREFIX):
            grammar.accept(token)
        assert not grammar.is_done
    rows = [(str(i), g) for i, g in enumerate(grammars)]
    logits = torch.randn(BATCH, vocab)
    fill_ms = per_step(lambda: grammar_bitmask(rows))
    mask = grammar_bitmask(rows)
    assert mask is not None
    bitmask, where = torch.from_numpy(mask.bitmask), torch.arange(BATCH)
    apply_ms = per_step(lambda: apply_token_bitmask(logits, where, bitmask))
    bare_ms = per_step(lambda: torch.multinomial(torch.softmax(logits, dim=-1), 1))
    print(
        f"structured output (batch {BATCH}, vocab {vocab}, JSON schema, 1 thread): bitmask "
        f"fill {fill_ms:.2f} ms + apply {apply_ms:.2f} ms per step vs bare softmax+multinomial "
        f"{bare_ms:.2f} ms (the limit, {(fill_ms + apply_ms) / bare_ms:.2f}x); schema compile "
        f"{first_ms:.0f} ms first, {cached_ms * 1e3:.0f} us cached"
    )


if __name__ == "__main__":
    main()
