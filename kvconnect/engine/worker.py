"""A tensor-parallel worker: its model shard, its paged KV cache shard, its connector.

Runs in its own process (`worker_main`), driven over a pipe by the executor:

    executor -> worker   SchedulerOutput (one per step), None (stop)
    worker -> executor   WorkerReady once, then a WorkerOutput per step, or WorkerFailed

The connector's part of a step runs through `connector.step.run_worker_step`, in vLLM's order,
with the forward pass inside it. Rank 0 samples the next tokens; every rank returns its
`KVConnectorOutput`.
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
from kvconnect.engine.shm_all_reduce import ShmAllReduce, ShmAllReduceHandle
from kvconnect.hashing import DEFAULT_ALGORITHM
from kvconnect.messages import KVConnectorOutput, ScheduledRequest, SchedulerOutput
from kvconnect.model.llama import AttentionMetadata, LayerHooks
from kvconnect.model.loader import load_model
from kvconnect.model_source import weights_identity


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

        def forward(hooks: LayerHooks | None) -> dict[str, int]:
            if prepared is None:
                return {}
            input_ids, positions, meta = prepared
            hidden = self.model(input_ids, positions, self.kv_caches, meta, hooks)
            return self._sample(scheduler_output, hidden, meta) if self.rank == 0 else {}

        if self.connector is None:
            return WorkerOutput(forward(None))
        assert scheduler_output.kv_connector_metadata is not None
        sampled, kv_output = run_worker_step(
            self.connector,
            scheduler_output.kv_connector_metadata,
            scheduler_output.finished_req_ids,
            forward,
            forward_context=ForwardContext(self.kv_caches_by_name, attn_metadata),
            attn_metadata=attn_metadata,
        )
        return WorkerOutput(sampled, kv_output)

    def _sample(
        self, scheduler_output: SchedulerOutput, hidden: torch.Tensor, meta: AttentionMetadata
    ) -> dict[str, int]:
        rows, reqs = [], []
        end = 0
        for s, n in zip(scheduler_output.scheduled, meta.query_lens, strict=True):
            end += n
            if s.sample:
                rows.append(end - 1)
                reqs.append(s)
        if not rows:
            return {}
        logits = self.model.compute_logits(hidden[rows])
        return {s.request_id: sample(row, s) for s, row in zip(reqs, logits, strict=True)}

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()
        if self._all_reduce is not None:
            self._all_reduce.close()


def sample(logits: torch.Tensor, s: ScheduledRequest) -> int:
    """One next token: greedy at temperature 0, else from softmax(logits / T), cut to the
    top_k most likely and to the smallest set reaching top_p. The random choice depends only
    on the request's seed and position, so it is the same at any TP size."""
    if s.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / s.temperature, dim=-1)
    if not bool(torch.isfinite(probs).all()):  # logits that overflow at this temperature
        return int(logits.argmax())
    if 0 < s.top_k < probs.numel() or s.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = torch.ones_like(sorted_probs, dtype=torch.bool)
        if 0 < s.top_k < probs.numel():
            keep[s.top_k :] = False
        if s.top_p < 1.0:  # keep a token while the mass before it is below top_p
            keep &= (sorted_probs.cumsum(0) - sorted_probs) < s.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    gen = torch.Generator().manual_seed(s.seed * 1_000_003 + s.num_output_tokens)
    return int(torch.multinomial(probs, 1, generator=gen))


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
