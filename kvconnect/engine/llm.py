"""`LLM`: the engine behind one call, as vLLM's offline API.

    llm = LLM(model="smollm2", kv_events_config='{"enable_kv_cache_events": true}')
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=8))
    reply = llm.chat([{"role": "user", "content": "What is the capital of France?"}])
    llm.shutdown()

The scheduler (block pool, scheduler-role connector, event publisher) lives in this process;
the model runs in `tensor_parallel_size` worker processes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from kvconnect.config import KVEventsConfig, KVTransferConfig
from kvconnect.connector.base import KVConnectorBase, KVConnectorRole
from kvconnect.connector.registry import KVConnectorFactory
from kvconnect.engine.block_pool import BlockPool
from kvconnect.engine.executor import EngineDeadError, Executor
from kvconnect.engine.output import OutputProcessor, RequestState
from kvconnect.engine.request import (
    CompletionOutput,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
)
from kvconnect.engine.scheduler import Scheduler, SchedulerConfig
from kvconnect.engine.worker import WorkerConfig
from kvconnect.hashing import DEFAULT_ALGORITHM
from kvconnect.model.loader import load_model_info
from kvconnect.stream.publisher import EventPublisher, EventPublisherFactory
from kvconnect.tokenizer import Message

logger = logging.getLogger(__name__)

C = TypeVar("C", KVEventsConfig, KVTransferConfig)
Prompt = str | Sequence[int]


def children(params: SamplingParams) -> list[SamplingParams]:
    """The n single-completion requests of `params` (seed s gives them s, s+1, ...)."""
    if params.n == 1:
        return [params]
    return [
        replace(params, n=1, seed=None if params.seed is None else params.seed + j)
        for j in range(params.n)
    ]


def as_config(cls: type[C], value: C | Mapping[str, Any] | str | None) -> C | None:
    """A config from the object itself, a dict, or vLLM-style JSON text."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        return cls.from_json(value)
    if isinstance(value, Mapping):
        return cls.from_dict(value)
    raise ValueError(f"{cls.__name__}: expected the object, a dict or JSON, got {value!r}")


class LLM:
    def __init__(
        self,
        model: str,
        tensor_parallel_size: int = 1,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        kv_transfer_config: KVTransferConfig | Mapping[str, Any] | str | None = None,
        kv_events_config: KVEventsConfig | Mapping[str, Any] | str | None = None,
        *,
        num_kv_blocks: int = 1024,
        dtype: str = "float32",
        seed: int = 0,
        max_num_batched_tokens: int = 1024,
        max_num_seqs: int = 64,
        enable_chunked_prefill: bool = True,
        max_model_len: int | None = None,
        hash_algorithm: str = DEFAULT_ALGORITHM,
        hash_seed: str | None = None,
        data_parallel_rank: int = 0,
        step_timeout: float = 60.0,
    ) -> None:
        self.model = model
        transfer = as_config(KVTransferConfig, kv_transfer_config)
        events = as_config(KVEventsConfig, kv_events_config)
        self.model_config, self.tokenizer = load_model_info(model)
        self.model_config.check_tensor_parallel(tensor_parallel_size)
        self.block_size = block_size
        self.hash_algorithm, self.hash_seed = hash_algorithm, hash_seed
        worker_config = WorkerConfig(
            model=model,
            tensor_parallel_size=tensor_parallel_size,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            dtype=dtype,
            seed=seed,
            kv_transfer_config=transfer,
            hash_algorithm=hash_algorithm,
            hash_seed=hash_seed,
            data_parallel_rank=data_parallel_rank,
            # The largest partial sum a step produces: every scheduled token's hidden state.
            all_reduce_bytes=max_num_batched_tokens * self.model_config.hidden_size * 8,
        )
        self.connector: KVConnectorBase | None = None
        if transfer is not None and transfer.kv_connector:
            self.connector = KVConnectorFactory.create_connector(
                worker_config.connector_context(0), KVConnectorRole.SCHEDULER
            )
        self.publisher: EventPublisher = EventPublisherFactory.create(events, data_parallel_rank)
        pool = BlockPool(
            num_kv_blocks,
            block_size,
            enable_caching=enable_prefix_caching,
            enable_kv_cache_events=events is not None and events.enable_kv_cache_events,
        )
        max_len = max_model_len or min(
            self.model_config.max_position_embeddings, num_kv_blocks * block_size
        )
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_batched_tokens, max_num_seqs, enable_chunked_prefill, max_len),
            pool,
            self.connector,
            self.publisher,
        )
        try:
            self.executor = Executor(
                worker_config,
                expected_finished_count=self.connector.get_finished_count()
                if self.connector
                else None,
                step_timeout=step_timeout,
            )
        except BaseException:
            self.publisher.shutdown()
            raise
        self.outputs = OutputProcessor(self.tokenizer)
        self._states: dict[str, RequestState] = {}
        self._next_id = 0
        self._closed = False

    # -- requests -------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        **kwargs: Any,
    ) -> Request:
        """Queue one request (n=1: `generate` fans out n); `ValueError` if it cannot run."""
        if params.n != 1:
            raise ValueError("add_request takes SamplingParams with n=1 (generate fans out n)")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_prompt(token_ids, params.max_tokens)
        if request_id is None:
            request_id, self._next_id = str(self._next_id), self._next_id + 1
        request = Request(
            request_id,
            token_ids,
            params,
            self.block_size,
            hash_algorithm=self.hash_algorithm,
            hash_seed=self.hash_seed,
            eos_token_id=self.tokenizer.eos_token_id,
            **kwargs,
        )
        self.scheduler.add_request(request)
        self._states[request.request_id] = self.outputs.add(request)
        return request

    def check_prompt(self, token_ids: Sequence[int], max_tokens: int) -> None:
        """`ValueError` saying why the engine cannot run this prompt (any thread may ask)."""
        if not token_ids:
            raise ValueError("the prompt has no tokens")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
            raise ValueError("prompt token ids must be integers")
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is not in the vocabulary [0, {vocab})")
        limit = self.scheduler.config.max_model_len
        if len(token_ids) + max_tokens > limit:
            raise ValueError(
                f"the prompt ({len(token_ids)} tokens) plus max_tokens ({max_tokens}) is more "
                f"than the model's context of {limit} tokens"
            )

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    def output_state(self, request_id: str) -> RequestState:
        """The text of a request's output so far (see `engine/output.py`)."""
        return self._states[request_id]

    def release(self, request_id: str) -> RequestState | None:
        """Forget a finished request's output state (after its last `take_delta`)."""
        return self._states.pop(request_id, None)

    def step(self) -> list[Request]:
        """One engine step; returns the requests that finished in it."""
        scheduler_output = self.scheduler.schedule()
        try:
            sampled, kv_output = self.executor.execute_model(scheduler_output)
        except EngineDeadError as e:
            self._fail_all(str(e))
            raise
        finished = self.scheduler.update_from_output(scheduler_output, sampled, kv_output)
        for request_id in sampled:
            state = self._states.get(request_id)
            if state is None or not self.outputs.update(state):
                continue
            if not state.request.status.is_finished:  # a stop string ends it now
                self.scheduler.abort_request(request_id, RequestStatus.FINISHED_STOPPED)
                finished.append(state.request)
        if not scheduler_output.scheduled:
            if scheduler_output.stuck_req_id is not None:
                raise RuntimeError(
                    f"request {scheduler_output.stuck_req_id!r} can never be scheduled: it "
                    f"needs more KV blocks than the pool has ({self.scheduler.pool.num_blocks})"
                )
            time.sleep(0.001)  # only transfers are in flight
        return finished

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order."""
        if self._closed:
            raise RuntimeError("LLM.generate() called after shutdown()")
        batch: list[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            batch = [prompts]  # type: ignore[list-item]
        else:
            batch = list(prompts)  # type: ignore[arg-type]
        params = sampling_params or SamplingParams()
        per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(batch)
        if len(per_prompt) != len(batch):
            raise ValueError(f"{len(per_prompt)} sampling params for {len(batch)} prompts")
        requests = [
            [self.add_request(p, child) for child in children(sp)]
            for p, sp in zip(batch, per_prompt, strict=True)
        ]
        while self.scheduler.has_unfinished_requests:
            self.step()
        deadline = time.monotonic() + 30
        while self.scheduler.has_pending_transfers and time.monotonic() < deadline:
            self.step()  # let async saves finish, so their blocks come back
        return [self._output(rs, p) for rs, p in zip(requests, batch, strict=True)]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or
        to several, each rendered with the model's chat template; generation stops at the
        model's end-of-sequence token (for SmolLM2, `<|im_end|>`)."""
        if messages and isinstance(messages[0], Mapping):
            conversations = [messages]
        else:
            conversations = list(messages)  # type: ignore[arg-type]
        prompts: list[Prompt] = [
            self.tokenizer.apply_chat_template(c, add_generation_prompt)  # type: ignore[arg-type]
            for c in conversations
        ]
        return self.generate(prompts, sampling_params)

    def _output(self, requests: list[Request], prompt: Prompt) -> RequestOutput:
        outputs = []
        for j, r in enumerate(requests):
            state = self.release(r.request_id)
            assert state is not None
            outputs.append(
                CompletionOutput(
                    j,
                    state.text,
                    list(r.output_token_ids),
                    r.status.finish_reason,
                    state.stop_reason,
                )
            )
        req = requests[0]
        return RequestOutput(
            request_id=req.request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=req.prompt_token_ids,
            outputs=outputs,
            finished=all(r.status.is_finished for r in requests),
            num_cached_tokens=req.num_cached_tokens or 0,
            num_external_tokens=req.num_external_tokens,
            kv_transfer_params=req.kv_transfer_params,
        )

    def _fail_all(self, reason: str) -> None:
        self.scheduler.fail_all(reason)
        self.shutdown(timeout=1.0)  # a worker is gone or stuck: do not wait long for the rest

    def reset_prefix_cache(self, reset_connector: bool = False) -> bool:
        """Empty the engine's prefix cache (and, if asked, the connector's: its workers clear
        their tiers at the next step); False while blocks are in use."""
        ok = self.scheduler.reset_prefix_cache(reset_connector)
        if reset_connector and self.connector is not None:
            self.step()  # carry the reset to the workers now
        return ok

    def reset_connector_cache(self) -> bool:
        """Empty only the connector's tiers (the engine's own cache stays); what they held is
        announced as removed, tier by tier. False without a connector."""
        if self.connector is None:
            return False
        ok = self.connector.reset_cache() is not False
        self.step()  # carry the reset to the workers now
        return ok

    def shutdown(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        self.executor.shutdown(timeout)
        if self.connector is not None:
            self.connector.shutdown()
        self.publisher.shutdown(timeout=1.0)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
