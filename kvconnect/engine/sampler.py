"""The sampler: a step's next tokens from its logits in one batched pass, with their logprobs.

    logits [num_rows, vocab]  float32, the model's output at each row that samples
      grammar bitmask         -inf on every token a row's grammar forbids (structured output;
                              as vLLM applies it before its sampler, logprobs see it too)
      raw logprobs            log_softmax of the rows that ask: vLLM's default logprobs_mode
                              ("raw_logprobs"), before anything below changes the logits
      bad words, min_tokens   -inf on the banned tokens
      logit_bias              added
      penalties               repetition over prompt + output tokens, frequency and presence
                              over output tokens: a gather and a scatter over each row's
                              distinct tokens, from per-request token counts
      greedy rows             argmax: done
      / temperature, softmax
      min_p                   probabilities below min_p x the row's largest dropped
      top_k, top_p            one sort of the rows that cut
      random rows             multinomial, with the row's own generator

This is vLLM v1's order (`Sampler.forward`, its builtin logits processors). A row's random
choice depends only on its request's seed and position (a generator seeded
`seed * 1_000_003 + num_output_tokens`), so a request samples the same at any TP size and in
any batch. top_p counts the mass of the whole distribution, before top_k (as kvconnect always
has; vLLM counts it within the top_k).

`Sampler` is the worker's stateful half. Per request id it keeps the `SamplingOptions` sent at
admission and what they need: prompt tokens (repetition penalty, prompt logprobs) and output
token counts, updated from the tokens each step computes (an output token is the next step's
input), never resent. A request's state goes when its id comes back in `finished_req_ids`.
Per-request Python work is only building the batch's small index tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvconnect.messages import (
    GrammarBitmask,
    PositionLogprobs,
    PromptLogprobs,
    SamplingOptions,
    ScheduledRequest,
    SchedulerOutput,
)

SEED_STRIDE = 1_000_003
"""A row's generator seed is `seed * SEED_STRIDE + num_output_tokens`, modulo 2**64 (what a
torch generator takes: a seed near 2**63 would overflow it and kill the worker)."""
PROMPT_CHUNK = 256
"""Prompt positions whose logits are computed at once (bounds the [positions, vocab] tensor)."""
TOP_P_HEAD = 256
"""Most likely tokens sorted first when cutting at top_p (more if the cut lies beyond)."""


@dataclass
class Penalties:
    """A batch's penalties, sparse: each row's distinct tokens only (a few hundred, not the
    vocabulary), as (rows, token ids, value) triples of equal length."""

    repeated: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    """Tokens of a row's prompt or output, with its repetition penalty."""
    output: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    """Tokens of a row's output, with frequency x count + presence (subtracted)."""


@dataclass
class SamplingBatch:
    """One step's sampling rows as tensors, one entry per row."""

    temperature: torch.Tensor
    """0 is greedy."""
    top_k: torch.Tensor
    """long; 0 (or -1) is no limit."""
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeds: list[int]
    """The seed of each row's generator."""
    penalties: Penalties | None = None
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    """(rows, token ids) that must not be sampled."""
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """(rows, token ids, values) added to the logits."""
    num_logprobs: list[int | None] = field(default_factory=list)
    """Alternatives each row asks for, None for no logprobs; empty if no row asks."""
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None
    """(rows, int32 bitmask [rows, ceil(vocab / 32)]): the tokens each row's grammar allows."""


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]
    """Per row: the sampled token's logprobs if the row asked."""


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """The next token of every row of `logits` [num_rows, vocab]; `logits` is not changed."""
    if batch.allowed is not None:
        logits = apply_token_bitmask(logits, *batch.allowed)
    asking = [i for i, k in enumerate(batch.num_logprobs) if k is not None]
    raw = torch.log_softmax(logits[asking], dim=-1) if asking else None
    logits = _grammar_first(logits, processed_logits(logits, batch), batch)
    tokens = logits.argmax(dim=-1)
    rows = torch.nonzero(batch.temperature > 0).flatten()
    if rows.numel():
        tokens[rows] = _sample_random(logits[rows], batch, rows, tokens[rows])
    logprobs: list[PositionLogprobs | None] = [None] * len(tokens)
    if raw is not None:
        nums = [k for k in batch.num_logprobs if k is not None]
        for i, lp in zip(asking, gather_logprobs(raw, tokens[asking], nums), strict=True):
            logprobs[i] = lp
    return SamplerOutput(tokens.tolist(), logprobs)


_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()
"""[256, 8]: the bits of each byte value, lowest first."""


def apply_token_bitmask(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
) -> torch.Tensor:
    """`logits` (a new tensor) with -inf at each token that `rows`' packed bitmask (xgrammar's
    layout: bit b of int32 word w is token 32 w + b) does not allow. Read as little-endian
    bytes (as x86 and ARM store words), token t is bit t % 8 of byte t // 8: one lookup of
    each byte's 8 bits unpacks it, no loop over the vocabulary (half the time of shifting each
    word 32 ways, measured)."""
    vocab = logits.shape[-1]
    allowed = _BYTE_BITS[bitmask.contiguous().view(torch.uint8).long()]
    allowed = allowed.reshape(len(rows), -1)[:, :vocab]
    logits = logits.clone()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits


def _grammar_first(
    masked: torch.Tensor, processed: torch.Tensor, batch: SamplingBatch
) -> torch.Tensor:
    """`processed`, except a grammar row whose bans (min_tokens, bad words) left it no token:
    that row keeps its grammar's tokens (e.g. EOS, the only token a complete grammar allows,
    under min_tokens), so that the output stays grammatical."""
    if batch.allowed is None or processed is masked:
        return processed
    dead = ~torch.isfinite(processed).any(dim=-1)
    if bool(dead.any()):
        processed[dead] = masked[dead]
    return processed


def processed_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """`logits` with banned tokens at -inf, the bias added and the penalties applied (a new
    tensor if any of them applies)."""
    if batch.banned is None and batch.bias is None and batch.penalties is None:
        return logits
    logits = logits.clone()
    if batch.banned is not None:
        logits.index_put_(batch.banned, torch.tensor(float("-inf")))
    if batch.bias is not None:
        rows, ids, values = batch.bias
        logits.index_put_((rows, ids), values, accumulate=True)
    if (p := batch.penalties) is not None:
        rows, ids, penalty = p.repeated  # distinct per row: a plain write is safe
        values = logits[rows, ids]
        logits[rows, ids] = torch.where(values > 0, values / penalty, values * penalty)
        rows, ids, amount = p.output
        logits.index_put_((rows, ids), -amount, accumulate=True)
    return logits


def _sample_random(
    logits: torch.Tensor, batch: SamplingBatch, rows: torch.Tensor, greedy: torch.Tensor
) -> torch.Tensor:
    """Tokens of the random `rows` (their `logits`); a row whose probabilities overflow at its
    temperature, or keep no mass after the cuts, takes its `greedy` token (multinomial would
    raise, and one request's extreme values would fail the whole step)."""
    probs, finite = random_probs(logits, batch, rows)
    mass = probs.sum(dim=-1)
    drawable = (torch.isfinite(mass) & (mass > 0)).tolist()
    out = greedy.clone()
    for j, (i, ok) in enumerate(zip(rows.tolist(), finite, strict=True)):
        if ok and drawable[j]:  # one draw per row: each has its own generator
            gen = torch.Generator().manual_seed(batch.seeds[i])
            out[j] = torch.multinomial(probs[j], 1, generator=gen)[0]
    return out


def random_probs(
    logits: torch.Tensor, batch: SamplingBatch, rows: torch.Tensor
) -> tuple[torch.Tensor, list[bool]]:
    """What the random `rows` draw from (unnormalised: multinomial takes weights), and which
    rows' softmax stayed finite at their temperature."""
    probs = torch.softmax(logits / batch.temperature[rows, None], dim=-1)
    finite = torch.isfinite(probs).all(dim=-1).tolist()
    min_p = batch.min_p[rows]
    if bool((min_p > 0).any()):
        probs = _cut_min_p(probs, min_p)
    return _cut_top_k_top_p(probs, batch.top_k[rows], batch.top_p[rows]), finite


def _cut_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Rows with min_p > 0 keep the tokens at least min_p x their top probability, renormed
    (so that top_p then counts within them, as in vLLM); other rows are left as they are."""
    kept = probs.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * min_p[:, None], 0.0)
    return torch.where((min_p > 0)[:, None], kept / kept.sum(dim=-1, keepdim=True), probs)


def _cut_top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero all but the top_k most likely tokens and the smallest set reaching top_p, in the
    rows that cut at all. Only their head is sorted (`topk`), grown until every row's cut
    falls inside it: the same tokens and values as a full sort, at a fraction of its cost
    (a full sort of 49k probabilities takes ~5 ms a row here)."""
    vocab = probs.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    cut = torch.nonzero((k < vocab) | (top_p < 1.0)).flatten()
    if not cut.numel():
        return probs
    k, top_p, rows = k[cut, None], top_p[cut, None], probs[cut]
    head = min(vocab, max([TOP_P_HEAD, *k[k < vocab].tolist()]))
    while True:
        head_probs, order = rows.topk(head, dim=-1)
        keep = torch.arange(head) < k
        # A token stays while the mass before it is below top_p; the most likely one always
        # stays (as in vLLM), even where top_p is 0 in float32 (a subnormal top_p, 1e-320).
        keep &= (head_probs.cumsum(dim=-1) - head_probs) < top_p
        keep[:, 0] = True
        if head == vocab or not bool((keep[:, -1] & (k[:, 0] > head)).any()):
            break
        head = min(vocab, head * 4)  # a row keeps its whole head: its cut lies beyond
    probs[cut] = torch.zeros_like(rows).scatter(-1, order, head_probs * keep)
    return probs


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, nums: list[int]
) -> list[PositionLogprobs]:
    """Per row of `logprobs` [rows, vocab]: its token's logprob and rank, and its `nums[row]`
    most likely tokens."""
    chosen = logprobs.gather(-1, token_ids[:, None])
    ranks = (logprobs >= chosen).sum(dim=-1).tolist()
    k = max(nums, default=0)
    top_values, top_ids = (
        logprobs.topk(k, dim=-1) if k else (chosen[:, :0], token_ids[:, None][:, :0])
    )
    rows = zip(
        token_ids.tolist(),
        chosen[:, 0].tolist(),
        ranks,
        top_ids.tolist(),
        top_values.tolist(),
        nums,
        strict=True,
    )
    return [
        PositionLogprobs(t, lp, r, tuple(ids[:n]), tuple(values[:n]))
        for t, lp, r, ids, values, n in rows
    ]


@dataclass
class _RequestSampling:
    """What the worker keeps of one request for its sampling."""

    options: SamplingOptions
    num_output_tokens: int
    """Output tokens counted so far."""
    output_tail: list[int]
    """Its last output tokens, as many as the longest bad word needs."""
    prompt_token_ids: list[int] | None
    """Kept for prompt logprobs only."""
    output_counts: torch.Tensor | None = None
    """float32 [vocab]: times each token is in the output (with penalties only)."""
    output_ids: torch.Tensor | None = None
    """The distinct tokens of the output (with penalties only)."""
    seen_ids: torch.Tensor | None = None
    """The distinct tokens of the prompt and the output (with a repetition penalty only)."""
    seen: torch.Tensor | None = None
    """bool [vocab]: `seen_ids` as a mask, to tell a new token from a repeated one."""
    bias: tuple[torch.Tensor, torch.Tensor] | None = None
    """(token ids, values) of its logit_bias."""


class Sampler:
    """The worker's sampler (rank 0): per-request state, and one batched pass per step."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._requests: dict[str, _RequestSampling] = {}

    @property
    def num_requests(self) -> int:
        """Requests whose state is kept (0 once every request has finished)."""
        return len(self._requests)

    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Before the step's forward: forget finished requests, take admitted requests'
        options, count the output tokens the step computes."""
        for request_id in scheduler_output.finished_req_ids:
            self._requests.pop(request_id, None)
        new = {r.request_id: r.all_token_ids for r in scheduler_output.scheduled_new_reqs}
        for s in scheduler_output.scheduled:
            if s.sampling is not None:
                self._admit(s.request_id, s.sampling, new[s.request_id])
            elif (state := self._requests.get(s.request_id)) is not None:
                first = state.options.num_prompt_tokens + state.num_output_tokens
                new_outputs = s.token_ids[max(0, first - s.start_position) :]
                if s.start_position + len(s.token_ids) > first and new_outputs:
                    self._count(state, new_outputs)

    def _admit(self, request_id: str, options: SamplingOptions, token_ids: list[int]) -> None:
        """(Re)start a request's state from all its tokens (prompt, then output so far)."""
        n = options.num_prompt_tokens
        prompt, outputs = token_ids[:n], token_ids[n:]
        state = _RequestSampling(
            options, 0, [], prompt if options.prompt_logprobs is not None else None
        )
        if options.has_penalties:
            state.output_counts = torch.zeros(self.vocab_size)
            state.output_ids = torch.zeros(0, dtype=torch.long)
        if options.repetition_penalty != 1.0:
            state.seen_ids = torch.unique(torch.tensor(prompt, dtype=torch.long))
            state.seen = torch.zeros(self.vocab_size, dtype=torch.bool)
            state.seen[state.seen_ids] = True
        if options.logit_bias:
            ids, values = zip(*options.logit_bias, strict=True)
            state.bias = torch.tensor(ids, dtype=torch.long), torch.tensor(values)
        self._requests[request_id] = state
        if outputs:
            self._count(state, outputs)

    def _count(self, state: _RequestSampling, token_ids: list[int]) -> None:
        state.num_output_tokens += len(token_ids)
        keep = max((len(w) for w in state.options.bad_words_token_ids), default=1) - 1
        state.output_tail = (state.output_tail + token_ids)[-keep:] if keep else []
        if state.output_counts is None or state.output_ids is None:
            return
        ids = torch.tensor(token_ids, dtype=torch.long)
        fresh = torch.unique(ids[state.output_counts[ids] == 0])
        state.output_ids = torch.cat([state.output_ids, fresh])
        state.output_counts.index_add_(0, ids, torch.ones(len(token_ids)))
        if state.seen is not None and state.seen_ids is not None:
            fresh = fresh[~state.seen[fresh]]
            state.seen[fresh] = True
            state.seen_ids = torch.cat([state.seen_ids, fresh])

    def sample(
        self,
        logits: torch.Tensor,
        reqs: list[ScheduledRequest],
        grammar_bitmask: GrammarBitmask | None = None,
    ) -> SamplerOutput:
        """The next token of each of `reqs` from its row of `logits`, within what the step's
        grammars allow."""
        return sample(logits, self.batch(reqs, grammar_bitmask))

    def batch(
        self, reqs: list[ScheduledRequest], grammar_bitmask: GrammarBitmask | None = None
    ) -> SamplingBatch:
        """The step's rows as tensors: the basics from the step message, the rest from the
        kept state, the grammars' bitmask from the step message."""
        states = [self._requests.get(s.request_id) for s in reqs]
        batch = SamplingBatch(
            temperature=torch.tensor([s.temperature for s in reqs]),
            # A top_k past the vocabulary is no limit (as 0 is): 2**63 fits no long tensor.
            top_k=torch.tensor([s.top_k if s.top_k < self.vocab_size else 0 for s in reqs]),
            top_p=torch.tensor([s.top_p for s in reqs]),
            min_p=torch.tensor([st.options.min_p if st else 0.0 for st in states]),
            seeds=[(s.seed * SEED_STRIDE + s.num_output_tokens) % 2**64 for s in reqs],
        )
        if any(states):
            self._add_controls(batch, reqs, states)
        if grammar_bitmask is not None:
            batch.allowed = _bitmask_rows(grammar_bitmask, reqs)
        return batch

    def _add_controls(
        self,
        batch: SamplingBatch,
        reqs: list[ScheduledRequest],
        states: list[_RequestSampling | None],
    ) -> None:
        pen = [(i, st) for i, st in enumerate(states) if st and st.output_counts is not None]
        if pen:
            batch.penalties = _penalties(pen)
        banned = [
            (i, t)
            for i, (s, st) in enumerate(zip(reqs, states, strict=True))
            if st
            for t in _banned(st, s.num_output_tokens)
        ]
        if banned:
            rows, ids = zip(*banned, strict=True)
            batch.banned = torch.tensor(rows, dtype=torch.long), torch.tensor(ids, dtype=torch.long)
        biased = [(i, st.bias) for i, st in enumerate(states) if st and st.bias is not None]
        if biased:
            batch.bias = (
                torch.cat([torch.full_like(b[0], i) for i, b in biased]),
                torch.cat([b[0] for _, b in biased]),
                torch.cat([b[1] for _, b in biased]),
            )
        batch.num_logprobs = [st.options.logprobs if st else None for st in states]

    def wants_prompt_logprobs(self, s: ScheduledRequest) -> bool:
        state = self._requests.get(s.request_id)
        return state is not None and state.prompt_token_ids is not None

    def prompt_logprobs(
        self,
        s: ScheduledRequest,
        hidden: torch.Tensor,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
    ) -> PromptLogprobs | None:
        """The prompt logprobs that this step's positions of `s` give (`hidden` holds their
        hidden states); None if the step computes no position before the prompt's last."""
        state = self._requests[s.request_id]
        prompt, k = state.prompt_token_ids, state.options.prompt_logprobs
        assert prompt is not None and k is not None
        start = s.start_position
        num = min(len(s.token_ids), len(prompt) - 1 - start)
        if num <= 0:
            return None
        targets = torch.tensor(prompt[start + 1 : start + 1 + num], dtype=torch.long)
        out: list[PositionLogprobs] = []
        for a in range(0, num, PROMPT_CHUNK):
            b = min(num, a + PROMPT_CHUNK)
            raw = torch.log_softmax(compute_logits(hidden[a:b]), dim=-1)
            out += gather_logprobs(raw, targets[a:b], [k] * (b - a))
        return PromptLogprobs(start + 1, out)


def _bitmask_rows(
    grammar_bitmask: GrammarBitmask, reqs: list[ScheduledRequest]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's bitmask with the batch row of each of its requests."""
    row_of = {s.request_id: i for i, s in enumerate(reqs)}
    rows = [row_of[request_id] for request_id in grammar_bitmask.request_ids]
    return torch.tensor(rows, dtype=torch.long), torch.from_numpy(grammar_bitmask.bitmask)


def _penalties(rows: list[tuple[int, _RequestSampling]]) -> Penalties:
    """The penalised rows' distinct tokens, concatenated (one small gather per request)."""
    repeated: list[tuple[int, torch.Tensor, float]] = []
    output: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    for i, st in rows:
        o = st.options
        assert st.output_counts is not None and st.output_ids is not None
        if st.seen_ids is not None:
            repeated.append((i, st.seen_ids, o.repetition_penalty))
        if o.frequency_penalty or o.presence_penalty:
            counts = st.output_counts[st.output_ids]
            output.append((i, st.output_ids, o.frequency_penalty * counts + o.presence_penalty))
    return Penalties(
        _triples([(i, ids, torch.full(ids.shape, rp)) for i, ids, rp in repeated]),
        _triples(output),
    )


def _triples(
    parts: list[tuple[int, torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, token ids, values) from each row's (row, token ids, values)."""
    if not parts:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty, torch.zeros(0)
    return (
        torch.cat([torch.full(ids.shape, i, dtype=torch.long) for i, ids, _ in parts]),
        torch.cat([ids for _, ids, _ in parts]),
        torch.cat([values for _, _, values in parts]),
    )


def _banned(state: _RequestSampling, num_output_tokens: int) -> list[int]:
    """Tokens this request must not sample now: stop tokens before min_tokens, and the last
    token of each bad word whose other tokens end the output (vLLM's `apply_bad_words`)."""
    o = state.options
    banned = list(o.min_tokens_banned_ids) if num_output_tokens < o.min_tokens else []
    tail = state.output_tail
    for word in o.bad_words_token_ids:
        prefix = list(word[:-1])
        if not prefix or (len(prefix) <= len(tail) and tail[len(tail) - len(prefix) :] == prefix):
            banned.append(word[-1])
    return banned
