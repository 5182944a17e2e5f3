"""Structured output: grammars compiled by xgrammar, one matcher per request, a token bitmask
per step.

    StructuredOutputsParams     what a request asks for (vLLM's `structured_outputs`): a JSON
                                schema, any JSON object, a regex, one of some choices, or an
                                EBNF grammar
    GrammarCompiler(tok, V)     compile(params) -> CompiledGrammar, an LRU keyed by the spec;
                                `ValueError` naming the field for a bad schema, regex or grammar
    Grammar                     a request's matcher: accept(token), is_terminated
    grammar_bitmask(rows)       the step's allowed tokens of the rows that have a grammar

Where the matchers live (as in vLLM): with the scheduler, in the engine's process. The
scheduler fills the bitmask for the step's sampling rows that have a grammar and ships it in
`SchedulerOutput.grammar_bitmask`; rank 0's sampler (the one that samples) sets every token the
mask forbids to -inf before anything else; the scheduler advances each matcher with the token
that comes back. So the workers hold no grammar state: any TP size samples the same, and a
preempted request keeps its matcher (its output tokens are kept too).

xgrammar's vocabulary is kvconnect's own: each token id's bytes in the decoded text
(`Tokenizer.token_bytes`), b"" for special tokens (xgrammar then never allows them), and the
end-of-sequence token as the stop token: a grammar that is complete allows only that, and
accepting it terminates the matcher.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvconnect.messages import GrammarBitmask
from kvconnect.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar as xgr

MAX_CACHED_GRAMMARS = 256
"""Compiled grammars kept (least recently used dropped first)."""
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
"""xgrammar's error messages start with a time and a C++ source location."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must be (vLLM's `StructuredOutputsParams`); exactly one field is set."""

    json: str | None = None
    """A JSON schema, as JSON text."""
    json_object: bool = False
    """Any JSON object (OpenAI's `response_format` json_object)."""
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    """Exactly one of these strings."""
    grammar: str | None = None
    """An EBNF grammar (xgrammar's GBNF dialect, `root ::= ...`)."""

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                "structured_outputs: exactly one of json, json_object, regex, choice, grammar "
                f"must be set, not {given or 'none'}"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice: must be non-empty strings")

    @property
    def field(self) -> str:
        """The field that is set."""
        if self.json_object:
            return "json_object"
        fields = ("json", "regex", "choice", "grammar")
        return next(k for k in fields if getattr(self, k) is not None)

    @property
    def key(self) -> tuple[str, str]:
        """(field, spec text): the cache key."""
        if self.json_object:
            return "json_object", ""
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        value = getattr(self, self.field)
        assert isinstance(value, str)
        return self.field, value


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar of exactly one of `choices` (each a JSON-escaped string literal, which
    xgrammar's EBNF reads)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles specs against one tokenizer's vocabulary; thread-safe (the server compiles to
    check a request, the engine thread then finds it cached). xgrammar is imported and its
    tokenizer info built on first use: an engine without structured requests never pays."""

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, max_cached: int = MAX_CACHED_GRAMMARS
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_cached = max_cached
        self.num_hits = 0
        self.num_misses = 0
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler: xgr.GrammarCompiler | None = None

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of `params`, from the cache if compiled before."""
        key = params.key
        with self._lock:
            if (found := self._cache.get(key)) is not None:
                self._cache.move_to_end(key)
                self.num_hits += 1
                return found
            self.num_misses += 1
        compiled = self._compile(params)  # outside the lock: a big schema must not stall others
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, params: StructuredOutputsParams) -> Grammar:
        """A new request's matcher."""
        import xgrammar as xgr

        return Grammar(xgr.GrammarMatcher(self.compile(params)), self.vocab_size)

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        try:
            compiler = self._xgrammar()
        except ImportError as e:  # an install without it: the request's 400, not a 500
            raise ValueError(
                f"structured_outputs.{params.field}: structured output needs the xgrammar "
                f"package, which this installation lacks ({e}); install kvconnect with its "
                "dependencies (pip install kvconnect) or xgrammar==0.2.8"
            ) from None
        try:
            if params.json is not None:
                json.loads(params.json)
                return compiler.compile_json_schema(params.json)
            if params.json_object:
                return compiler.compile_json_schema('{"type": "object"}')
            if params.regex is not None:
                return compiler.compile_regex(params.regex)
            if params.choice is not None:
                return compiler.compile_grammar(choice_grammar(params.choice))
            assert params.grammar is not None
            return compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            lines = str(e).strip().splitlines() or [type(e).__name__]
            why = _XGR_PREFIX.sub("", lines[0])
            raise ValueError(f"structured_outputs.{params.field}: {why}") from None

    def _xgrammar(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = _new_compiler(self.tokenizer, self.vocab_size)
            return self._compiler


def _new_compiler(tokenizer: Tokenizer, vocab_size: int) -> xgr.GrammarCompiler:
    """xgrammar's compiler over the tokenizer's token bytes; its own cache off (ours is the
    LRU above), one thread (the machine's cores run the model)."""
    import xgrammar as xgr

    vocab = tokenizer.token_bytes()[:vocab_size]
    eos = tokenizer.eos_token_id
    info = xgr.TokenizerInfo(
        vocab,
        xgr.VocabType.RAW,
        vocab_size=vocab_size,
        stop_token_ids=None if eos is None else [eos],
    )
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


class Grammar:
    """One request's matcher, advanced with each token it outputs."""

    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        """The width of its bitmask: the model's vocabulary."""
        self.is_terminated = False
        """The grammar is complete and its stop token taken: the request is done."""
        self.rejected = False
        """A token the grammar does not allow came (a row whose every token was masked by
        another control, e.g. min_tokens banning the only allowed EOS): the request ends."""

    def accept(self, token_id: int) -> None:
        if self.is_terminated or self.rejected:
            return
        if not self._matcher.accept_token(token_id):
            self.rejected = True
            return
        self.is_terminated = self._matcher.is_terminated()

    @property
    def is_done(self) -> bool:
        return self.is_terminated or self.rejected

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)


def grammar_bitmask(rows: list[tuple[str, Grammar]]) -> GrammarBitmask | None:
    """The allowed tokens of each (request id, grammar) row, as xgrammar's packed bitmask:
    int32 [rows, ceil(vocab / 32)], bit b of word w allowing token 32 w + b. None if no row."""
    if not rows:
        return None
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(rows), rows[0][1].vocab_size)
    for i, (_, grammar) in enumerate(rows):
        grammar.fill_bitmask(bitmask, i)
    return GrammarBitmask([request_id for request_id, _ in rows], np.asarray(bitmask.numpy()))


__all__ = [
    "Grammar",
    "GrammarCompiler",
    "StructuredOutputsParams",
    "choice_grammar",
    "grammar_bitmask",
]
