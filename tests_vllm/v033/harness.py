"""vLLM 0.33's own scheduler driving kvconnect's connector, with the model runner played by the
test (the way vLLM's tests/v1/kv_connector/unit drive connectors): every object on the
scheduler's side is vLLM's (`Scheduler`, `KVCacheManager`, the connector factory, the ZMQ event
publisher, `KVOutputAggregator` folding the ranks' outputs); every worker rank is a real
connector instance of role WORKER over real CPU tensors.

What the test plays is the forward pass, per rank and step, in the order vLLM 0.33's model
runner calls the connector (`kv_connector_model_runner_mixin`):

    handle_preemptions, bind_connector_metadata, [start_load_kv if the step has sync loads],
    the forward, [start_load_kv], wait_for_save, get_transfer_results,
    get_block_ids_with_load_errors, get_kv_connector_stats, build_connector_worker_meta,
    clear_connector_metadata

The forward first reads the context of each scheduled request (every position before the
step's first token must hold that token's KV, as attention would read it: a wrong or missing
load fails there), then writes the KV of the scheduled tokens. A token's KV is a function of
its position, its token id, the layer, K or V, the rank, head and dim (`kv_value`), so the same
prefix has the same KV on every run, and each rank's heads differ from the other's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import get_forward_context, set_forward_context
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvconnect.events import KVCacheEvent
from kvconnect.stream.subscriber import KVEventSubscriber, ReceivedBatch

BLOCK = 16
LAYERS, HEADS, DIM = 2, 2, 4  # per rank
EOS = 2
SAMPLED = 7  # the token every sampling step "generates"


def kv_value(layer: int, kv: int, rank: int, position: int, token: int) -> torch.Tensor:
    """[HEADS, DIM] KV of one token on one rank: distinct per (layer, K/V, rank, position,
    token, head, dim), exact in float32."""
    base = (position * 50021 + token * 31 + layer * 7 + kv * 3 + rank * 101) % 65521
    return (torch.arange(HEADS * DIM, dtype=torch.float32).view(HEADS, DIM) + base * 16) % 1_048_573


def transfer(extra: dict[str, Any], connector: str = "OffloadConnector") -> dict[str, Any]:
    """An OffloadConnector entry of a kv-transfer config (also a MultiConnector child)."""
    return {
        "kv_connector": connector,
        "kv_connector_module_path": "kvconnect.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def cpu_tier(chunk_size: int = 32, max_chunks: int = 64) -> dict[str, Any]:
    """A cpu tier whose hits load async, as disk, redis and peer hits always do: this suite
    drives that path under vLLM 0.33's Scheduler (sync cpu loads run in vLLM 0.32's servers,
    tests_vllm/test_offload.py and test_peer_pull.py)."""
    chunk_bytes = LAYERS * 2 * chunk_size * HEADS * DIM * 4
    return {
        "chunk_size": chunk_size,
        "sync_cpu_loads": False,
        "tiers": [{"kind": "cpu", "max_bytes": max_chunks * chunk_bytes}],
    }


def make_vllm_config(
    model_dir: Path,
    kv_transfer: dict[str, Any],
    events_dir: Path,
    *,
    tp: int = 1,
    num_blocks: int = 256,
    max_num_batched_tokens: int = 64,
) -> VllmConfig:
    # SmolLM2 has 9 heads and 3 KV heads; at TP 2 the config says 8 and 2 (vLLM checks only
    # that they divide: no weights are loaded).
    heads = {} if 9 % tp == 0 else {"num_attention_heads": 8, "num_key_value_heads": 2}
    model = ModelConfig(
        model=str(model_dir), dtype="float32", seed=0, max_model_len=1024, hf_overrides=heads
    )
    config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=1024,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        kv_transfer_config=KVTransferConfig(kv_load_failure_policy="recompute", **kv_transfer),
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"ipc://{events_dir}/events",
            replay_endpoint=f"ipc://{events_dir}/replay",
        ),
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = num_blocks
    return config


class Events:
    """Every event the scheduler's publisher sent, read by kvconnect's subscriber."""

    def __init__(self, events_dir: Path) -> None:
        self.items: list[KVCacheEvent] = []
        self._dir = events_dir
        self._cond = threading.Condition()
        self._sub = KVEventSubscriber(
            f"ipc://{events_dir}/events", f"ipc://{events_dir}/replay", start_seq=0
        )
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for item in self._sub:
                if isinstance(item, ReceivedBatch):
                    with self._cond:
                        self.items.extend(item.batch.events)
                        self._cond.notify_all()
        except BaseException as e:  # said by wait_for: a dead reader is not "no events"
            self._error = e
            raise

    def wait_for(self, what: Callable[[list[KVCacheEvent]], bool], timeout: float = 60) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: what(self.items), timeout):
                sub = self._sub
                raise AssertionError(
                    f"events never met the condition; got {self.items}; subscriber: "
                    f"reader alive {self._thread.is_alive()}, error {self._error!r}, "
                    f"connected {sorted(sub.connected)}, handshakes {sub.num_handshakes}, "
                    f"replayed {sub.num_batches_replayed}, replay failures "
                    f"{sub.num_replay_failures}, bad frames {sub.num_bad_frames}; the publisher's "
                    f"sockets {sorted(p.name for p in self._dir.iterdir() if p.is_socket())}"
                )

    def snapshot(self) -> list[KVCacheEvent]:
        with self._cond:
            return list(self.items)

    def close(self) -> None:
        self._sub.close()


@dataclass
class Rank:
    """One worker: its connector and its paged KV cache (flash-style NHD per layer)."""

    rank: int
    connector: Any
    caches: dict[str, torch.Tensor]


@dataclass
class StepResult:
    output: SchedulerOutput
    model_output: ModelRunnerOutput
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    engine_outputs: list[Any] = field(default_factory=list)
    """vLLM's EngineCoreOutput of each request this step."""
    scheduler_stats: list[Any] = field(default_factory=list)
    """vLLM's SchedulerStats of this step (its connector's prefix cache stats, hits by
    source among them)."""

    def prefill_stats(self, request_id: str) -> Any:
        """vLLM's PrefillStats of the request's first output, if this step produced it."""
        for out in self.engine_outputs:
            if out.request_id == request_id and out.prefill_stats is not None:
                return out.prefill_stats
        return None


class Engine:
    """vLLM 0.33's Scheduler and `tp` worker ranks, stepped by the test."""

    def __init__(self, config: VllmConfig, num_blocks: int, slow_forward: bool = False) -> None:
        """`slow_forward`: each forward lasts until the workers' I/O threads are idle (a
        forward longer than the step's loads, as a real one over a long batch would be)."""
        init_none_hash(sha256)
        self.config = config
        self.slow_forward = slow_forward
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float32
        )
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(names, spec)],
        )
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
            log_stats=True,
        )
        self.ranks: list[Rank] = []
        for r in range(config.parallel_config.tensor_parallel_size):
            config.parallel_config.rank = r  # what vLLM sets in each worker process
            connector = KVConnectorFactory.create_connector(
                config=config, role=KVConnectorRole.WORKER, kv_cache_config=self.kv_cache_config
            )
            caches = {
                n: torch.zeros(2, num_blocks, BLOCK, HEADS, DIM, dtype=torch.float32) for n in names
            }
            connector.register_kv_caches(caches)
            self.ranks.append(Rank(r, connector, caches))
        config.parallel_config.rank = 0
        self.aggregator = KVOutputAggregator.from_connector(
            self.ranks[0].connector, len(self.ranks)
        )
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.steps = 0

    # -- requests -------------------------------------------------------------------------------

    def add(self, request_id: str, prompt: list[int], max_tokens: int = 2) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, EOS)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
            block_hasher=self.hasher,
        )
        self.scheduler.add_request(request)
        return request

    def block_ids(self, request_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(request_id)[0])

    # -- a step ---------------------------------------------------------------------------------

    def step(self) -> StepResult:
        so = self.scheduler.schedule()
        outputs = [self._run_rank(rank, so) for rank in self.ranks]
        model_output = self.aggregator.aggregate(outputs)
        assert model_output is not None
        kv_out = model_output.kv_connector_output
        result = StepResult(
            so,
            model_output,
            set(kv_out.finished_recving or ()) if kv_out else set(),
            set(kv_out.invalid_block_ids or ()) if kv_out else set(),
        )
        outputs = self.scheduler.update_from_output(so, model_output)
        result.engine_outputs = [o for core in outputs.values() for o in core.outputs]
        result.scheduler_stats = [
            core.scheduler_stats for core in outputs.values() if core.scheduler_stats is not None
        ]
        self.steps += 1
        return result

    def _run_rank(self, rank: Rank, so: SchedulerOutput) -> ModelRunnerOutput:
        connector = rank.connector
        meta = so.kv_connector_metadata
        assert meta is not None
        connector.handle_preemptions(meta)
        connector.bind_connector_metadata(meta)
        with set_forward_context(None, self.config):
            if so.has_sync_kv_loads:
                connector.start_load_kv(get_forward_context())
            sampled = self._forward(rank, so)
            if not so.has_sync_kv_loads:
                connector.start_load_kv(get_forward_context())
            connector.wait_for_save()
        results = connector.get_transfer_results(so.finished_req_ids)
        kv_out = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=set(results.failed_recving),
            invalid_block_ids=connector.get_block_ids_with_load_errors(),
            kv_connector_stats=connector.get_kv_connector_stats(),
            kv_cache_events=connector.get_kv_connector_kv_cache_events(),
            kv_connector_worker_meta=connector.build_connector_worker_meta(),
        )
        connector.clear_connector_metadata()
        req_ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled.get(r, []) for r in req_ids],
            kv_connector_output=None if kv_out.is_empty() else kv_out,
        )

    def _forward(self, rank: Rank, so: SchedulerOutput) -> dict[str, list[int]]:
        """Read each scheduled request's context, write its new tokens' KV; the tokens sampled
        by requests whose prompt is complete after this step."""
        sampled: dict[str, list[int]] = {}
        for req_id, num in so.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            end = request.num_computed_tokens  # advanced by schedule()
            start = end - num
            blocks = self.block_ids(req_id)
            tokens = request.all_token_ids
            self.check_kv(rank, blocks, tokens, 0, start, req_id)
            for p in range(start, end):
                for li, cache in enumerate(rank.caches.values()):
                    for kv in (0, 1):
                        cache[kv, blocks[p // BLOCK], p % BLOCK] = kv_value(
                            li, kv, rank.rank, p, tokens[p]
                        )
            if end >= request.num_tokens:
                sampled[req_id] = [SAMPLED]
        if self.slow_forward and so.total_num_scheduled_tokens:
            assert rank.connector.worker.drain()
        return sampled

    def check_kv(
        self, rank: Rank, blocks: list[int], tokens: Any, start: int, end: int, what: str
    ) -> None:
        for p in range(start, end):
            for li, cache in enumerate(rank.caches.values()):
                for kv in (0, 1):
                    got = cache[kv, blocks[p // BLOCK], p % BLOCK]
                    want = kv_value(li, kv, rank.rank, p, tokens[p])
                    if not torch.equal(got, want):
                        raise AssertionError(
                            f"{what}: rank {rank.rank} layer {li} kv {kv} position {p} "
                            f"(block {blocks[p // BLOCK]}) holds {got.flatten()[:4].tolist()}, "
                            f"not {want.flatten()[:4].tolist()}"
                        )

    # -- driving --------------------------------------------------------------------------------

    def run_until(
        self, done: Callable[[StepResult], bool], max_steps: int = 400, timeout: float = 60
    ) -> list[StepResult]:
        """Step until `done(result)`; the I/O threads run meanwhile (no step waits for them),
        so a bound on time as well as steps."""
        results: list[StepResult] = []
        deadline = time.monotonic() + timeout
        while len(results) < max_steps and time.monotonic() < deadline:
            results.append(self.step())
            if done(results[-1]):
                return results
            if not self.scheduler.has_requests() and not self.pending_push():
                time.sleep(0.001)  # idle engine: vLLM's core polls has_pending_push_work
        raise AssertionError(f"not done after {len(results)} steps")

    def finish(self, request_id: str) -> list[StepResult]:
        return self.run_until(lambda _: request_id not in self.scheduler.requests)

    def settle(self) -> None:
        """Step while the connector has work under way (stores, their events, a reset). How
        many steps that takes depends on the I/O threads, not on the steps: only the time is
        bounded (a fresh-clone run used up 400 steps before a reset under MultiConnector was
        done)."""
        self.run_until(lambda _: not self.pending_push(), max_steps=1_000_000)

    def pending_push(self) -> bool:
        connector = self.scheduler.connector
        return connector is not None and bool(connector.has_pending_push_work())

    def status(self, request_id: str) -> RequestStatus:
        return self.scheduler.requests[request_id].status

    def shutdown(self) -> None:
        for rank in self.ranks:
            rank.connector.shutdown()
        self.scheduler.shutdown()


@contextmanager
def engine(
    model_dir: Path,
    kv_transfer: dict[str, Any],
    tmp: Path,
    *,
    tp: int = 1,
    num_blocks: int = 256,
    max_num_batched_tokens: int = 64,
    slow_forward: bool = False,
) -> Iterator[tuple[Engine, Events]]:
    config = make_vllm_config(
        model_dir,
        kv_transfer,
        tmp,
        tp=tp,
        num_blocks=num_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    eng = Engine(config, num_blocks, slow_forward)
    events = Events(tmp)
    try:
        yield eng, events
    finally:
        events.close()
        eng.shutdown()
