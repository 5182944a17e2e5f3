"""Requests, sampling parameters and outputs."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kvconnect.hashing import DEFAULT_ALGORITHM, ExtraKeys, RequestBlockHasher, to_event


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token."""

    max_tokens: int = 16
    """New tokens to generate at most."""
    temperature: float = 0.0
    """0 is greedy; above 0 samples from softmax(logits / temperature)."""
    seed: int | None = None
    """Seed of a sampled request's random choices; None uses the request's index."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens={self.max_tokens!r}: must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature!r}: must be >= 0")


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
        """Prompt tokens a connector loaded."""
        self.num_preemptions = 0
        self.error: str | None = None
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

    def check_stop(self) -> RequestStatus | None:
        """The finished status this request has reached, if any."""
        if not self.output_token_ids:
            return None
        params = self.sampling_params
        if (
            not params.ignore_eos
            and self.eos_token_id is not None
            and self.output_token_ids[-1] == self.eos_token_id
        ):
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
