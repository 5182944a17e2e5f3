"""A tensor-parallel worker: its model shard, its paged KV cache shard, its connector.

Runs in its own process (`worker_main`), driven over a pipe by the executor:

    executor -> worker   SchedulerOutput (one per step), None (stop)
    worker -> executor   WorkerReady once, then a WorkerOutput per step, or WorkerFailed

The connector's part of a step runs through `connector.step.run_worker_step`, in vLLM's order,
with the forward pass inside it. Rank 0 samples the next tokens; every rank returns its
`KVConnectorOutput`. Sampling is `engine/sampler.py`: one batched pass per step. A worker
keeps no grammar: the step message carries the bitmask of the rows that have one (the
scheduler keeps the matchers, `engine/structured_output.py`).
"""

from __future__ import annotations

import contextlib
import os
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from kvconnect.config import KVTransferConfig
from kvconnect.connector.base import KVConnectorBase, KVConnectorContext, KVConnectorRole
from kvconnect.connector.registry import KVConnectorFactory
from kvconnect.connector.step import run_worker_step
from kvconnect.engine.sampler import Sampler
from kvconnect.engine.shm_all_reduce import ShmAllReduce, ShmAllReduceHandle
from kvconnect.hashing import DEFAULT_ALGORITHM
from kvconnect.messages import (
    KVConnectorOutput,
    PositionLogprobs,
    PromptLogprobs,
    SchedulerOutput,
)
from kvconnect.model.llama import AttentionMetadata, LayerHooks
from kvconnect.model.loader import load_model
from kvconnect.model.source import weights_identity


@dataclass(frozen=True)
class WorkerConfig:
    model: str
    tensor_parallel_size: int
    block_size: int
    num_kv_blocks: int
    dtype: str = "float32"
    seed: int = 0
    kv_transfer_config: KVTransferConfig | None = None
    hash_algorithm: str = DEFAULT_ALGORITHM
    hash_seed: str | None = None
    data_parallel_rank: int = 0
    dist_store: str = ""
    """File of the torch.distributed FileStore the workers meet at (TP > 1), in a private
    directory: a TCPStore would listen on every interface."""
    num_threads: int = 0
    """Torch threads per worker; 0 shares the machine's cores among the workers."""
    all_reduce_bytes: int = 0
    """Largest tensor the shared-memory all-reduce takes; larger ones go through gloo."""
    all_reduce: ShmAllReduceHandle | None = None
    """Set by the executor when tensor_parallel_size > 1."""

    def connector_context(self, rank: int) -> KVConnectorContext:
        assert self.kv_transfer_config is not None
        return KVConnectorContext(
            self.kv_transfer_config,
            world_size=self.tensor_parallel_size,
            rank=rank,
            block_size=self.block_size,
            model_name=self.model,
            model_fingerprint=f"{weights_identity(self.model)};dtype={self.dtype};seed={self.seed}",
            hash_algorithm=self.hash_algorithm,
            hash_seed=self.hash_seed,
            data_parallel_rank=self.data_parallel_rank,
        )


@dataclass
class WorkerReady:
    """The worker loaded its shard and waits for steps."""

    pid: int


@dataclass
class WorkerOutput:
    """One step's result."""

    sampled: dict[str, int] = field(default_factory=dict)
    """Next token per sampling request (rank 0 only)."""
    logprobs: dict[str, PositionLogprobs] = field(default_factory=dict)
    """The sampled token's logprobs, for requests that ask (rank 0 only)."""
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    """Prompt logprobs of the positions computed this step, for requests that ask."""
    kv_connector_output: KVConnectorOutput | None = None


@dataclass
class WorkerFailed:
    """The worker raised; it stops after sending this."""

    traceback: str

    @property
    def last_line(self) -> str:
        lines = self.traceback.strip().splitlines()
        return lines[-1] if lines else "(no traceback)"


WorkerReply = WorkerReady | WorkerOutput | WorkerFailed


@dataclass
class ForwardContext:
    """What `start_load_kv` gets: the KV caches by layer name and this step's layout."""

    kv_caches: dict[str, torch.Tensor]
    attn_metadata: AttentionMetadata | None


class ModelRunner:
    def __init__(self, config: WorkerConfig, rank: int) -> None:
        self.config = config
        self.rank = rank
        self.model, _ = load_model(
            config.model, rank, config.tensor_parallel_size, config.dtype, config.seed
        )
        self._all_reduce: ShmAllReduce | None = None
        if config.all_reduce is not None:
            self._all_reduce = ShmAllReduce(config.all_reduce, rank)
            self.model.set_all_reduce(self._all_reduce)
        dtype = next(self.model.parameters()).dtype
        shape = self.model.kv_cache_shape(config.num_kv_blocks, config.block_size)
        self.kv_caches = [torch.zeros(shape, dtype=dtype) for _ in self.model.layer_names]
        self.kv_caches_by_name = dict(zip(self.model.layer_names, self.kv_caches, strict=True))
        self.sampler = Sampler(self.model.config.vocab_size)
        self.connector: KVConnectorBase | None = None
        if config.kv_transfer_config is not None and config.kv_transfer_config.kv_connector:
            self.connector = KVConnectorFactory.create_connector(
                config.connector_context(rank), KVConnectorRole.WORKER
            )
            self.connector.register_kv_caches(self.kv_caches_by_name)

    def _prepare(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.config.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, context_lens, tables = [], [], []
        for s in scheduler_output.scheduled:
            n = len(s.token_ids)
            token_ids += s.token_ids
            pos = range(s.start_position, s.start_position + n)
            positions += pos
            slots += [s.block_ids[p // bs] * bs + p % bs for p in pos]
            query_lens.append(n)
            context_lens.append(s.start_position + n)
            tables.append(s.block_ids)
        meta = AttentionMetadata(
            query_lens, context_lens, tables, torch.tensor(slots, dtype=torch.long), bs
        )
        return torch.tensor(token_ids), torch.tensor(positions), meta

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> WorkerOutput:
        prepared = self._prepare(scheduler_output) if scheduler_output.scheduled else None
        attn_metadata = prepared[2] if prepared is not None else None

        if self.rank == 0:
            self.sampler.update(scheduler_output)

        def forward(hooks: LayerHooks | None) -> WorkerOutput:
            if prepared is None:
                return WorkerOutput()
            input_ids, positions, meta = prepared
            hidden = self.model(input_ids, positions, self.kv_caches, meta, hooks)
            return (
                self._sample(scheduler_output, hidden, meta) if self.rank == 0 else WorkerOutput()
            )

        if self.connector is None:
            return forward(None)
        assert scheduler_output.kv_connector_metadata is not None
        out, kv_output = run_worker_step(
            self.connector,
            scheduler_output.kv_connector_metadata,
            scheduler_output.finished_req_ids,
            forward,
            forward_context=ForwardContext(self.kv_caches_by_name, attn_metadata),
            attn_metadata=attn_metadata,
        )
        out.kv_connector_output = kv_output
        return out

    def _sample(
        self, scheduler_output: SchedulerOutput, hidden: torch.Tensor, meta: AttentionMetadata
    ) -> WorkerOutput:
        """The step's next tokens (one batched pass over the sampling rows) and the logprobs
        that requests asked for, prompt positions included."""
        out = WorkerOutput()
        rows, reqs = [], []
        end = 0
        for s, n in zip(scheduler_output.scheduled, meta.query_lens, strict=True):
            if self.sampler.wants_prompt_logprobs(s):
                lps = self.sampler.prompt_logprobs(
                    s, hidden[end : end + n], self.model.compute_logits
                )
                if lps is not None:
                    out.prompt_logprobs[s.request_id] = lps
            end += n
            if s.sample:
                rows.append(end - 1)
                reqs.append(s)
        if rows:
            result = self.sampler.sample(
                self.model.compute_logits(hidden[rows]), reqs, scheduler_output.grammar_bitmask
            )
            for s, token_id, lp in zip(reqs, result.token_ids, result.logprobs, strict=True):
                out.sampled[s.request_id] = token_id
                if lp is not None:
                    out.logprobs[s.request_id] = lp
        return out

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()
        if self._all_reduce is not None:
            self._all_reduce.close()


def worker_main(config: WorkerConfig, rank: int, conn: Connection) -> None:
    """Process entry: set up, say ready, then run steps until told to stop."""
    runner: ModelRunner | None = None
    tp = config.tensor_parallel_size
    try:
        threads = config.num_threads or max(1, (os.cpu_count() or 1) // tp)
        torch.set_num_threads(threads)
        if tp > 1:
            # Gloo's pair sockets listen on the interface named here: loopback unless told.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            dist.init_process_group(
                "gloo",
                store=dist.FileStore(config.dist_store, tp),  # type: ignore[attr-defined]
                rank=rank,
                world_size=tp,
                timeout=timedelta(seconds=60),
            )
        runner = ModelRunner(config, rank)
        reply: WorkerReply = WorkerReady(os.getpid())
        conn.send(reply)
        while True:
            msg: SchedulerOutput | None = conn.recv()
            if msg is None:
                break
            reply = runner.execute(msg)
            conn.send(reply)
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        pass  # the engine went away
    except BaseException:
        with contextlib.suppress(OSError, EOFError):
            conn.send(WorkerFailed(traceback.format_exc()))
    finally:
        if runner is not None:
            runner.shutdown()
        if tp > 1 and dist.is_initialized():
            dist.destroy_process_group()
