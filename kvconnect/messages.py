"""The messages of one engine step: what the scheduler sends the workers, what they send back.

    scheduler --SchedulerOutput (with the connector's KVConnectorMetadata)--> every worker
    worker    --KVConnectorOutput (with the connector's KVConnectorWorkerMetadata)--> executor
    executor  --one KVConnectorOutput, folded across workers--> scheduler

Scheduler-side and worker-side code share these types and nothing else; the engine, the
connectors and the tests all use this one set. Everything here crosses a process boundary
(pickled over the executor's pipe to its own spawned workers), so it holds data, not handles.

This module imports nothing from the rest of the package.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt


class KVConnectorMetadata:
    """Scheduler -> worker, one per step, built by `build_connector_meta`. "None" is no data."""


class KVConnectorWorkerMetadata(ABC):
    """Worker -> scheduler, one per worker per step, built by `build_connector_worker_meta`.

    The executor folds all workers' non-None objects of a step with `aggregate`, left to right
    in rank order, before the scheduler-side connector sees the result. Make `aggregate`
    associative and independent of order; carry rank identity inside when counts matter,
    since nothing in the fold says how many workers contributed. Returning a new object and
    mutating `self` are both allowed. Must be picklable (it crosses process boundaries).
    """

    @abstractmethod
    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """The fold of `self` and `other` (another worker's metadata of the same step)."""


@dataclass
class KVConnectorStats:
    """Telemetry for the interval since the last report. The default merge adds numbers and
    concatenates lists key by key; connectors with other needs subclass it."""

    data: dict[str, Any] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            mine = self.data.get(key)
            if mine is None:
                self.data[key] = list(value) if isinstance(value, list) else value
            elif isinstance(mine, list):
                mine.extend(value)
            else:
                self.data[key] = mine + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """Flat numbers for metrics: lists become their length."""
        return {k: len(v) if isinstance(v, list) else v for k, v in self.data.items()}

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not self.data


@dataclass
class KVConnectorOutput:
    """What one worker (or, after aggregation, all workers) report for one step."""

    finished_sending: set[str] | None = None
    """Requests whose async save/send finished (after aggregation: on every worker)."""
    finished_recving: set[str] | None = None
    """Requests whose async load/receive finished (after aggregation: on every worker)."""
    kv_connector_stats: KVConnectorStats | None = None
    kv_connector_worker_meta: KVConnectorWorkerMetadata | None = None
    """The connector's own worker -> scheduler data, events included."""
    invalid_block_ids: set[int] = field(default_factory=set)
    """Blocks whose external load failed; the scheduler recomputes them."""
    expected_finished_count: int = 0
    """0: no change. >0: how many worker reports a newly tracked request id needs."""

    def is_empty(self) -> bool:
        """True only when no field carries news (`expected_finished_count` is not news)."""
        return not (
            self.finished_sending
            or self.finished_recving
            or (self.kv_connector_stats is not None and not self.kv_connector_stats.is_empty())
            or self.kv_connector_worker_meta is not None
            or self.invalid_block_ids
        )


@dataclass
class ScheduledRequest:
    """What the workers compute for one request this step."""

    request_id: str
    token_ids: list[int]
    """The tokens computed this step."""
    start_position: int
    """Position of the first of them (the request's computed tokens so far)."""
    block_ids: list[int]
    """The request's whole block table."""
    sample: bool = False
    """The step reaches the request's last token: sample the next one."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    num_output_tokens: int = 0
    sampling: SamplingOptions | None = None
    """On the request's first step after each admission, if it uses any control beyond
    temperature, top_p and top_k: the worker keeps it, with the token counts it needs, until
    the request id comes back in `finished_req_ids`. None on later steps."""


@dataclass(frozen=True)
class SamplingOptions:
    """The sampling controls a worker keeps per request (`SamplingParams` has their meaning).

    Sent once per admission, not every step. The worker learns the request's tokens from
    what it computes: `NewRequestData.all_token_ids` at admission (prompt, then any output
    kept across a preemption), then each output token as the next step's input."""

    num_prompt_tokens: int
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    min_tokens_banned_ids: tuple[int, ...] = ()
    """What `min_tokens` keeps from being sampled: stop_token_ids and EOS (even with
    ignore_eos, as in vLLM)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )


@dataclass(frozen=True, slots=True)
class PositionLogprobs:
    """Log-probabilities at one position: the token there and the most likely alternatives.

    From the raw logits (vLLM's default `logprobs_mode`, "raw_logprobs"): log_softmax of the
    model's output before temperature, penalties, bias or masks."""

    token_id: int
    """The token sampled (or, for prompt logprobs, the prompt's token) at this position."""
    logprob: float
    rank: int
    """1 + the number of other tokens at least as likely (vLLM's rank: 1 is the top)."""
    top_token_ids: tuple[int, ...] = ()
    """The `logprobs` (or `prompt_logprobs`) most likely tokens, most likely first; their
    ranks are 1, 2, ..."""
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """A step's prompt logprobs for one request: of prompt tokens `start`, `start + 1`, ...
    (a prompt's token 0 has none; its token i is scored from the logits at position i - 1)."""

    start: int
    logprobs: list[PositionLogprobs]


@dataclass
class NewRequestData:
    """A request entering the running set (first time, or again after preemption)."""

    request_id: str
    all_token_ids: list[int]
    block_hashes: list[bytes]
    block_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    """Part of block 0's hash (and of its KV events' extra keys)."""


@dataclass
class GrammarBitmask:
    """The tokens the grammars allow this step, for the sampling rows whose request has one
    (filled by the scheduler, which keeps the matchers: engine/structured_output.py)."""

    request_ids: list[str]
    bitmask: npt.NDArray[np.int32]
    """[len(request_ids), ceil(vocab / 32)]: bit b of word w set if token 32 w + b is allowed."""


@dataclass
class SchedulerOutput:
    """One step's work for the workers, and what connectors read in `build_connector_meta`."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    """Requests that finished since the previous step (workers pass them to get_finished)."""
    preempted_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: KVConnectorMetadata | None = None
    stuck_req_id: str | None = None
    """A waiting request that does not fit even though nothing else holds blocks."""
    grammar_bitmask: GrammarBitmask | None = None
    """None when no sampling row this step has a grammar."""

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())
