"""Requests, sampling parameters and outputs."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvconnect.engine.structured_output import Grammar, StructuredOutputsParams
from kvconnect.hashing import DEFAULT_ALGORITHM, ExtraKeys, RequestBlockHasher, to_event
from kvconnect.messages import PositionLogprobs, SamplingOptions
from kvconnect.model.tokenizer import Tokenizer

SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy (vLLM's `_SAMPLING_EPS`)."""
FLOAT32_MAX = 3.4028234663852886e38
"""The largest float32: a repetition penalty above it cannot be a sampler value."""
MAX_LOGPROBS = 20
"""Most alternatives `logprobs` and `prompt_logprobs` may ask for (vLLM's `max_logprobs`)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop (vLLM's names)."""

    n: int = 1
    """Completions per prompt (`LLM.generate` runs n requests; seed s gives them s, s+1, ...)."""
    max_tokens: int = 16
    """New tokens to generate at most."""
    temperature: float = 0.0
    """0 is greedy; above 0 samples from softmax(logits / temperature). Below `SAMPLING_EPS`
    it is 0, as in vLLM."""
    top_p: float = 1.0
    """Sample only from the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Sample only from the k most likely tokens; 0 (or -1) means all."""
    seed: int | None = None
    """Seed of a sampled request's random choices; None uses the request's id."""
    stop: tuple[str, ...] = ()
    """Strings that end the output when generated; the output does not include them."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end the output when generated (included in token_ids, as EOS is)."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the output already holds; in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the output holds it; in [-2, 2]."""
    repetition_penalty: float = 1.0
    """For tokens of the prompt or the output: a positive logit is divided by it, a negative
    one multiplied; > 0, 1 is off (vLLM's, after the CTRL paper)."""
    min_p: float = 0.0
    """Sample only tokens at least min_p times as likely as the most likely one (after
    temperature); in [0, 1], 0 is off."""
    min_tokens: int = 0
    """Output tokens before EOS or a stop token id may be sampled (and a stop string end
    the output); at most max_tokens."""
    logit_bias: Mapping[int, float] | None = None
    """Added to the logits of these token ids before sampling (the OpenAI API clamps each
    to [-100, 100])."""
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    """Token sequences never to generate: the last token of one is banned wherever the output
    ends with the rest of it (vLLM's `bad_words`, after tokenizing each word both bare and
    with a leading space)."""
    logprobs: int | None = None
    """Return each output token's logprob and rank, with this many most likely alternatives
    (0 to 20)."""
    prompt_logprobs: int | None = None
    """Return each prompt token's logprob (the first is None) with this many alternatives
    (0 to 20). Such a request reads nothing from the prefix cache, as in vLLM."""
    structured_outputs: StructuredOutputsParams | None = None
    """What the output must be (a JSON schema, a regex, ...): only tokens its grammar allows
    are sampled, and the request stops when the grammar is complete."""

    def __post_init__(self) -> None:
        self._check_basics()
        self._check_controls()

    def _fail(self, name: str, why: str) -> ValueError:
        return ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

    def _check_basics(self) -> None:
        fail = self._fail
        if not _is_int(self.n) or self.n < 1:
            raise fail("n", "must be an integer >= 1")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise fail("max_tokens", "must be an integer >= 1")
        if not _is_number(self.temperature) or not 0 <= self.temperature <= 100:
            raise fail("temperature", "must be a number in [0, 100]")
        if self.temperature < SAMPLING_EPS:  # as vLLM: greedy (logits / 1e-320 is inf)
            object.__setattr__(self, "temperature", 0.0)
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise fail("top_p", "must be a number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise fail("top_k", "must be an integer >= -1 (0 or -1: no limit)")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise fail("seed", "must be an integer in [0, 2**63)")
        stop: object = self.stop  # one string is accepted for a tuple of one, as in vLLM
        object.__setattr__(self, "stop", (stop,) if isinstance(stop, str) else tuple(self.stop))
        if not all(isinstance(s, str) and s for s in self.stop):
            raise fail("stop", "must be non-empty strings")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise fail("stop_token_ids", "must be token ids (integers >= 0)")

    def _check_controls(self) -> None:
        """The penalties, masks and logprobs, with vLLM's bounds."""
        fail = self._fail
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise fail(name, "must be a number in [-2, 2]")
        rp = self.repetition_penalty
        if not _is_number(rp) or not 0 < rp <= FLOAT32_MAX:  # the sampler's tensors are fp32
            raise fail("repetition_penalty", f"must be a number in (0, {FLOAT32_MAX:.7g}]")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise fail("min_p", "must be a number in [0, 1]")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise fail("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}]")
        if self.logit_bias is not None:
            bias = dict(self.logit_bias) if isinstance(self.logit_bias, Mapping) else None
            if bias is None or not all(
                _is_int(t) and t >= 0 and _is_number(b) and abs(b) < float("inf")
                for t, b in bias.items()
            ):
                raise fail("logit_bias", "must map token ids (integers >= 0) to finite numbers")
            object.__setattr__(self, "logit_bias", bias or None)
        words: object = self.bad_words_token_ids
        if not isinstance(words, list | tuple) or not all(
            isinstance(w, list | tuple) and w and all(_is_int(t) and t >= 0 for t in w)
            for w in words
        ):
            raise fail("bad_words_token_ids", "must be non-empty sequences of token ids")
        object.__setattr__(self, "bad_words_token_ids", tuple(tuple(w) for w in words))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise fail(name, f"must be None or an integer in [0, {MAX_LOGPROBS}]")

    def check_token_ids(self, vocab_size: int) -> None:
        """`ValueError` naming the field if a token id here is not in [0, vocab_size)."""
        fields = {
            "stop_token_ids": self.stop_token_ids,
            "logit_bias": tuple(self.logit_bias or ()),
            "bad_words_token_ids": tuple(t for w in self.bad_words_token_ids for t in w),
        }
        for name, ids in fields.items():
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise self._fail(name, f"token id {bad} is not in the vocabulary [0, {vocab_size})")


def bad_words_token_ids(words: Sequence[str], tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    """vLLM's `bad_words` (strings) as `SamplingParams.bad_words_token_ids`: each word bare,
    and with a leading space if that gives another first token and as many tokens (the word
    at the start of the text, and within it). `ValueError` naming bad_words for an empty word
    or one that encodes to no token."""
    out: list[tuple[int, ...]] = []
    for word in dict.fromkeys(words):
        if not isinstance(word, str) or not word:
            raise ValueError(f"bad_words: {word!r} is not a non-empty string")
        bare = tuple(tokenizer.encode(word.lstrip()))
        if not bare:
            raise ValueError(f"bad_words: {word!r} encodes to no token")
        out.append(bare)
        spaced = tuple(tokenizer.encode(" " + word.lstrip()))
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return tuple(out)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self.value.startswith("finished")

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's name for how a finished request ended; None while it runs."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One generation request as the scheduler tracks it."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        block_size: int,
        *,
        hash_algorithm: str = DEFAULT_ALGORITHM,
        hash_seed: str | None = None,
        eos_token_id: int | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        cache_salt: str | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt has no tokens")
        self.request_id = request_id
        self.cache_salt = cache_salt or None  # "" is no salt, as in vLLM
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.kv_transfer_params = kv_transfer_params
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None
        """Prompt tokens found in the engine's prefix cache; None until first scheduled."""
        self.num_external_tokens = 0
        self.external_hit_sources: dict[str, int] = {}
        """`num_external_tokens` by where the connector loaded them from (`CacheHitSource`)."""
        """Prompt tokens a connector loaded."""
        self.num_preemptions = 0
        self.error: str | None = None
        self.grammar: Grammar | None = None
        """The matcher of `sampling_params.structured_outputs`, set by the engine."""
        self._hasher = RequestBlockHasher(
            block_size, algorithm=hash_algorithm, seed=hash_seed, cache_salt=cache_salt
        )
        self._hasher.append(self.prompt_token_ids)

    @property
    def block_hashes(self) -> list[bytes]:
        """Chained hashes of every full block of the request's tokens."""
        return self._hasher.block_hashes

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def event_extra_keys(self, block_index: int) -> ExtraKeys | None:
        """Block `block_index`'s extra keys as KV events carry them (untagged)."""
        return to_event(self._hasher.extra_keys(block_index))

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self._hasher.append([token_id])
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def sampling_options(self) -> SamplingOptions | None:
        """What the workers keep for this request's sampling; None if it uses nothing beyond
        temperature, top_p and top_k."""
        p = self.sampling_params
        options = SamplingOptions(
            num_prompt_tokens=len(self.prompt_token_ids),
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty,
            min_p=p.min_p if p.temperature > 0 else 0.0,  # greedy ignores it, as in vLLM
            min_tokens=p.min_tokens,
            min_tokens_banned_ids=self._stop_ids() if p.min_tokens else (),
            logit_bias=tuple((p.logit_bias or {}).items()),
            bad_words_token_ids=p.bad_words_token_ids,
            logprobs=p.logprobs,
            # Handed out with the first token: a request preempted after it needs them no more.
            prompt_logprobs=None if self.output_token_ids else p.prompt_logprobs,
        )
        return None if options == SamplingOptions(options.num_prompt_tokens) else options

    def _stop_ids(self) -> tuple[int, ...]:
        eos = () if self.eos_token_id is None else (self.eos_token_id,)
        return tuple(dict.fromkeys([*self.sampling_params.stop_token_ids, *eos]))

    def check_stop(self) -> RequestStatus | None:
        """The finished status this request has reached, if any."""
        if not self.output_token_ids:
            return None
        if self.grammar is not None and self.grammar.is_done:
            return RequestStatus.FINISHED_STOPPED  # nothing more is grammatical
        params = self.sampling_params
        if len(self.output_token_ids) < params.min_tokens:
            return None
        last = self.output_token_ids[-1]
        if (
            not params.ignore_eos and self.eos_token_id is not None and last == self.eos_token_id
        ) or last in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if len(self.output_token_ids) >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    """"stop", "length", "abort" or "error"."""
    stop_reason: str | int | None = None
    """The stop string or stop token that ended it; None for EOS or a length limit."""
    logprobs: list[PositionLogprobs] | None = None
    """One per token of token_ids, if `SamplingParams.logprobs` asked."""


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    """Prompt tokens found in the engine's own prefix cache."""
    num_external_tokens: int = 0
    """Prompt tokens a KV connector loaded."""
    kv_transfer_params: dict[str, Any] | None = field(default=None)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    """One per prompt token (the first None), if `SamplingParams.prompt_logprobs` asked."""
