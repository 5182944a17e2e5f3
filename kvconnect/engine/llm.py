"""`LLM`: the engine behind one call, as vLLM's offline API.

    llm = LLM(model="smollm2", kv_events_config='{"enable_kv_cache_events": true}')
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=8))
    reply = llm.chat([{"role": "user", "content": "What is the capital of France?"}])
    llm.shutdown()

The scheduler (block pool, scheduler-role connector, event publisher) lives in this process;
the model runs in it too at tensor_parallel_size 1, else in one worker process per rank
(`engine/executor.py`).

A server drives it through this surface alone, from one thread (`serve/engine_loop.py`):

    info                     `EngineInfo`: the model, its limits, its tokenizer (any thread)
    add_request(...)         queue one request; `ValueError` if it cannot run (the one check)
    step()                   one engine step -> a `RequestDelta` per request that progressed
    abort(request_ids)       end requests now; no step reports them again
    has_unfinished_requests, has_pending_transfers, needs_idle_steps     when to step
    check_alive()            `EngineDeadError` if a worker is gone (an idle caller asks)
    stats()                  `EngineStats`, a snapshot for metrics (any thread)

`step()` and `check_alive()` raise `EngineDeadError` once a worker is gone; every request has
then failed and the engine is shut down.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from kvconnect.config import KVEventsConfig, KVTransferConfig
from kvconnect.connector.base import KVConnectorBase, KVConnectorRole
from kvconnect.connector.registry import KVConnectorFactory
from kvconnect.engine.block_pool import BlockPool
from kvconnect.engine.executor import BACKENDS, EngineDeadError, Executor, default_backend
from kvconnect.engine.multiproc_executor import MultiprocExecutor
from kvconnect.engine.output import OutputProcessor, RequestDelta, RequestState, request_output
from kvconnect.engine.request import Request, RequestOutput, RequestStatus, SamplingParams
from kvconnect.engine.scheduler import Scheduler, SchedulerConfig
from kvconnect.engine.structured_output import GrammarCompiler
from kvconnect.engine.uniproc_executor import UniProcExecutor
from kvconnect.engine.worker import WorkerConfig
from kvconnect.hashing import DEFAULT_ALGORITHM
from kvconnect.messages import SchedulerOutput
from kvconnect.model.loader import load_model_info
from kvconnect.model.tokenizer import Message, Tokenizer
from kvconnect.stream.publisher import EventPublisher, EventPublisherFactory

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


@dataclass(frozen=True)
class EngineInfo:
    """What a front needs to know of the engine; fixed at start, so any thread may read it."""

    model: str
    """The model as `LLM(model=...)` named it."""
    max_model_len: int
    """Prompt plus output tokens of one request, at most."""
    vocab_size: int
    """Token ids are in [0, vocab_size)."""
    tokenizer: Tokenizer
    """The model's tokenizer (encode, decode, chat template)."""
    grammars: GrammarCompiler
    """Compiles structured-output specs (cached): a front checks a request's with it, and
    the engine finds it compiled."""


@dataclass(frozen=True)
class EngineStats:
    """The engine's load now and its totals since start, for metrics."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    """Share of the KV cache blocks in use, 0-1."""
    num_preemptions: int
    num_events_published: int
    """KV cache events (not batches) handed to the publisher."""
    num_event_batches_published: int
    num_event_batches_dropped: int
    """Batches not sent live because the publisher's queue was full (still replayable)."""
    num_event_subscriptions: int
    connector: dict[str, int | float]
    """The connector's own stats, totals since start; empty without a connector."""
    connector_health: str | None = None
    """What keeps the connector from progress now (`KVConnectorBase.health`), if anything."""


def _scheduler_connector(config: WorkerConfig) -> KVConnectorBase | None:
    """The scheduler-role connector that the transfer config names; None without one."""
    transfer = config.kv_transfer_config
    if transfer is None or not transfer.kv_connector:
        return None
    return KVConnectorFactory.create_connector(
        config.connector_context(0), KVConnectorRole.SCHEDULER
    )


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
        distributed_executor_backend: str | None = None,
    ) -> None:
        """Load the model's config and tokenizer, build the scheduler side (connector,
        publisher, block pool, scheduler), then start the workers: in this process for one
        rank (`distributed_executor_backend` "uni", vLLM's default there), else (or with "mp")
        one process per rank."""
        transfer = as_config(KVTransferConfig, kv_transfer_config)
        events = as_config(KVEventsConfig, kv_events_config)
        self.model = model
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
        self.info = self._describe(max_model_len, num_kv_blocks * block_size)
        max_len = self.info.max_model_len
        self.connector = _scheduler_connector(worker_config)
        self.publisher: EventPublisher = EventPublisherFactory.create(events, data_parallel_rank)
        self.scheduler = self._create_scheduler(
            SchedulerConfig(max_num_batched_tokens, max_num_seqs, enable_chunked_prefill, max_len),
            num_kv_blocks,
            enable_prefix_caching,
            events is not None and events.enable_kv_cache_events,
        )
        backend = distributed_executor_backend or default_backend(tensor_parallel_size)
        self.executor = self._start_executor(worker_config, backend, step_timeout)
        self.outputs = OutputProcessor(self.tokenizer)
        self._states: dict[str, RequestState] = {}
        self._progressed: dict[str, None] = {}  # an ordered set: stepped since the last take
        self._next_id = 0
        self._closed = False

    def _describe(self, max_model_len: int | None, kv_cache_tokens: int) -> EngineInfo:
        """The engine's limits: `max_model_len` if given, else the most that both the model's
        positions and the KV cache hold."""
        limit = max_model_len or min(self.model_config.max_position_embeddings, kv_cache_tokens)
        vocab = self.model_config.vocab_size
        grammars = GrammarCompiler(self.tokenizer, vocab)
        return EngineInfo(self.model, limit, vocab, self.tokenizer, grammars)

    def _create_scheduler(
        self,
        config: SchedulerConfig,
        num_kv_blocks: int,
        enable_prefix_caching: bool,
        enable_kv_cache_events: bool,
    ) -> Scheduler:
        """The scheduler over a new block pool, with this engine's connector and publisher."""
        pool = BlockPool(
            num_kv_blocks,
            self.block_size,
            enable_caching=enable_prefix_caching,
            enable_kv_cache_events=enable_kv_cache_events,
        )
        return Scheduler(config, pool, self.connector, self.publisher)

    def _start_executor(self, config: WorkerConfig, backend: str, step_timeout: float) -> Executor:
        """Start the workers; if they cannot start, the publisher's sockets are closed too."""
        expected = self.connector.get_finished_count() if self.connector else None
        try:
            if backend not in BACKENDS:
                raise ValueError(
                    f"distributed_executor_backend={backend!r}: expected one of "
                    + ", ".join(BACKENDS)
                )
            if backend == "uni":
                return UniProcExecutor(config, expected_finished_count=expected)
            return MultiprocExecutor(config, expected, step_timeout=step_timeout)
        except BaseException:
            self.publisher.shutdown()
            raise

    # -- requests -------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        **kwargs: Any,
    ) -> Request:
        """Queue one request (n=1: `generate` fans out n). `ValueError` saying why if it cannot
        run: this is the one check of a prompt, whichever front it came through."""
        if params.n != 1:
            raise ValueError("add_request takes SamplingParams with n=1 (generate fans out n)")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_prompt(token_ids, params.max_tokens)
        params.check_token_ids(self.info.vocab_size)
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
        if params.structured_outputs is not None:
            request.grammar = self.info.grammars.matcher(params.structured_outputs)
        self.scheduler.add_request(request)
        self._states[request.request_id] = self.outputs.add(request)
        return request

    def _check_prompt(self, token_ids: Sequence[int], max_tokens: int) -> None:
        """`ValueError` saying why the engine cannot run this prompt."""
        if not token_ids:
            raise ValueError("the prompt has no tokens")
        vocab = self.info.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
            raise ValueError("prompt token ids must be integers")
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is not in the vocabulary [0, {vocab})")
        limit = self.info.max_model_len
        if len(token_ids) + max_tokens > limit:
            raise ValueError(
                f"the prompt ({len(token_ids)} tokens) plus max_tokens ({max_tokens}) is more "
                f"than the model's context of {limit} tokens"
            )

    def abort(self, request_ids: Iterable[str]) -> None:
        """End these requests now (finish reason "abort"); no step reports them again.
        Unknown and finished ids are ignored."""
        for request_id in request_ids:
            self.scheduler.abort_request(request_id)
            self._states.pop(request_id, None)
            self._progressed.pop(request_id, None)

    @property
    def has_unfinished_requests(self) -> bool:
        """Requests wait, run or load: step until this is False."""
        return self.scheduler.has_unfinished_requests

    @property
    def has_pending_transfers(self) -> bool:
        """Async saves of finished requests (or loads of aborted ones) still hold blocks;
        steps bring them back."""
        return self.scheduler.has_pending_transfers

    @property
    def needs_idle_steps(self) -> bool:
        """True with a connector: its tiers finish stores in the background, so an idle
        caller should still step now and then, for them to be reported and published."""
        return self.connector is not None

    # -- steps ----------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """One engine step. Returns a delta for each request that progressed since the last
        `step()` (new tokens, text, or its end), in scheduling order; a request's finished
        delta is its last, and the engine forgets the request's output then."""
        self._advance()
        return self._take_deltas()

    def _advance(self) -> None:
        """Schedule, execute and apply one step; decode what was sampled (a stop string
        finishes its request now). The deltas wait for `_take_deltas`."""
        scheduler_output = self.scheduler.schedule()
        try:
            out, kv_output = self.executor.execute_model(scheduler_output)
        except EngineDeadError as e:
            self._fail_all(str(e))
            raise
        self.scheduler.update_from_output(scheduler_output, out.sampled, kv_output)
        for request_id, prompt_logprobs in out.prompt_logprobs.items():
            if (state := self._states.get(request_id)) is not None:
                state.add_prompt_logprobs(prompt_logprobs)
        for request_id in out.sampled:
            state = self._states.get(request_id)
            if state is None:
                continue
            state.add_logprobs(out.logprobs.get(request_id))
            self._progressed[request_id] = None
            if self.outputs.update(state) and not state.request.status.is_finished:
                self.scheduler.abort_request(request_id, RequestStatus.FINISHED_STOPPED)
        if not scheduler_output.scheduled:
            self._check_stuck(scheduler_output)
            time.sleep(0.001)  # only transfers are in flight

    def _check_stuck(self, scheduler_output: SchedulerOutput) -> None:
        """`RuntimeError` if a waiting request could not run even in an empty pool."""
        if scheduler_output.stuck_req_id is not None:
            raise RuntimeError(
                f"request {scheduler_output.stuck_req_id!r} can never be scheduled: it "
                f"needs more KV blocks than the pool has ({self.scheduler.pool.num_blocks})"
            )

    def _take_deltas(self) -> list[RequestDelta]:
        """What the requests stepped since the last take have new; the finished are forgotten."""
        deltas = []
        for request_id in self._progressed:
            delta = self._states[request_id].take_delta()
            if delta is None:
                continue  # its token was dropped (its blocks are recomputed)
            if delta.finished:
                del self._states[request_id]
            deltas.append(delta)
        self._progressed.clear()
        return deltas

    def check_alive(self) -> None:
        """`EngineDeadError` if a worker process has exited (an idle caller asks now and
        then); as after a failed step, every request has then failed and the engine is shut
        down."""
        try:
            self.executor.check_alive()
        except EngineDeadError as e:
            self._fail_all(str(e))
            raise

    def stats(self) -> EngineStats:
        """A snapshot for metrics; any thread may ask (it may straddle a step)."""
        sched, pub = self.scheduler, self.publisher
        reduced = sched.connector_stats.reduce() if sched.connector_stats is not None else {}
        # A connector of connectors nests its children's stats objects: those are no number.
        connector = {k: v for k, v in sorted(reduced.items()) if isinstance(v, int | float)}
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            kv_cache_usage=sched.pool.usage,
            num_preemptions=sched.stats.num_preemptions,
            num_events_published=sched.stats.num_events_published,
            num_event_batches_published=pub.num_published,
            num_event_batches_dropped=pub.num_dropped,
            num_event_subscriptions=pub.num_subscriptions,
            connector=connector,
            connector_health=sched.connector.health() if sched.connector is not None else None,
        )

    # -- offline generation ---------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order. A prompt
        the engine cannot run is a `ValueError`, and nothing of the call runs."""
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
        requests: list[list[Request]] = []
        try:
            for p, sp in zip(batch, per_prompt, strict=True):
                requests.append([self.add_request(p, child) for child in children(sp)])
        except ValueError:
            self.abort(r.request_id for rs in requests for r in rs)
            raise
        deltas = self._run_to_completion()
        return [
            request_output(rs, p if isinstance(p, str) else None, deltas)
            for rs, p in zip(requests, batch, strict=True)
        ]

    def _run_to_completion(self) -> dict[str, list[RequestDelta]]:
        """Step until every request has finished; each request's deltas, in order."""
        deltas: dict[str, list[RequestDelta]] = {}
        while self.scheduler.has_unfinished_requests:
            for delta in self.step():
                deltas.setdefault(delta.request_id, []).append(delta)
        deadline = time.monotonic() + 30
        while self.scheduler.has_pending_transfers and time.monotonic() < deadline:
            self.step()  # let async saves finish, so their blocks come back
        return deltas

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

    # -- the engine as a whole ------------------------------------------------------------

    def _fail_all(self, reason: str) -> None:
        self.scheduler.fail_all(reason)
        self.shutdown(timeout=1.0)  # a worker is gone or stuck: do not wait long for the rest

    def reset_prefix_cache(self, reset_connector: bool = False) -> bool:
        """Empty the engine's prefix cache (and, if asked, the connector's: its workers clear
        their tiers at the next step); False while blocks are in use."""
        ok = self.scheduler.reset_prefix_cache(reset_connector)
        if reset_connector and self.connector is not None:
            self._advance()  # carry the reset to the workers now (deltas wait for step())
        return ok

    def reset_connector_cache(self) -> bool:
        """Empty only the connector's tiers (the engine's own cache stays); what they held is
        announced as removed, tier by tier. False without a connector."""
        if self.connector is None:
            return False
        ok = self.connector.reset_cache() is not False
        self._advance()  # carry the reset to the workers now (deltas wait for step())
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


__all__ = ["LLM", "EngineInfo", "EngineStats", "RequestDelta", "as_config", "children"]
