"""Test connectors and a minimal step loop that drives them with the real aggregator.

`WorkerEventsConnector` stores blocks on the workers (a per-rank in-memory store with LRU
eviction) and reports `BlockStored`/`BlockRemoved` through `KVEventsWorkerMetadata`; its
scheduler half releases them with an `EventQuorum`. `SchedulerEventsConnector` produces events
on the scheduler side only. Both record every call, for the MultiConnector tests.

`StepLoop` runs one scheduler-role instance and `world_size` worker-role instances, each
worker's part through `run_worker_step` (the engine's own step order), pickling the metadata
both ways as a process boundary would.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvconnect.config import KVTransferConfig
from kvconnect.connector import (
    ConnectorRequest,
    KVConnectorBase,
    KVConnectorContext,
    KVConnectorFactory,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVConnectorStats,
    KVConnectorWorkerMetadata,
    NewRequestData,
    SchedulerOutput,
)
from kvconnect.connector.aggregator import KVOutputAggregator
from kvconnect.connector.events import EventQuorum, KVEventsWorkerMetadata
from kvconnect.connector.step import ConnectorLayerHooks, run_worker_step
from kvconnect.events import BlockRemoved, BlockStored, KVCacheEvent
from kvconnect.hashing import block_hashes, to_wire

MODULE = __name__


@dataclass
class FakeRequest:
    request_id: str
    all_token_ids: list[int]
    block_hashes: list[bytes] = field(default_factory=list)
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: str | None = None

    @classmethod
    def make(cls, request_id: str, token_ids: list[int], block_size: int = 4) -> FakeRequest:
        return cls(request_id, token_ids, block_hashes(token_ids, block_size))


class Recording(KVConnectorBase):
    """Records calls; abstract methods do nothing beyond that."""

    def __init__(self, context: KVConnectorContext, role: KVConnectorRole) -> None:
        super().__init__(context, role)
        self.calls: list[tuple[Any, ...]] = []
        self.extra = context.kv_transfer_config.kv_connector_extra_config

    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        self.calls.append(("start_load_kv",))

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append(("wait_for_layer_load", layer_name))

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any = None, **kwargs: Any
    ) -> None:
        self.calls.append(("save_kv_layer", layer_name))

    def wait_for_save(self) -> None:
        self.calls.append(("wait_for_save",))

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self.calls.append(("get_num_new_matched_tokens", request.request_id, num_computed_tokens))
        return self.extra.get("matched_tokens", 0), False

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        self.calls.append(
            ("update_state_after_alloc", request.request_id, block_ids, num_external_tokens)
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self.calls.append(("build_connector_meta",))
        return KVConnectorMetadata()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.calls.append(("update_connector_output", connector_output.kv_connector_worker_meta))
        # A child's view is its own: changing it must not reach the other children.
        if connector_output.finished_sending is not None:
            connector_output.finished_sending.add(f"scribbled-by-{id(self)}")

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        items = self.extra.get("worker_meta")
        return None if items is None else SetMetadata(set(items))

    def shutdown(self) -> None:
        self.calls.append(("shutdown",))
        if "shutdown_error" in self.extra:
            raise RuntimeError(self.extra["shutdown_error"])

    def reset_cache(self) -> bool | None:
        result: bool | None = self.extra.get("reset_result")
        return result


@dataclass
class SetMetadata(KVConnectorWorkerMetadata):
    items: set[str]

    def aggregate(self, other: KVConnectorWorkerMetadata) -> SetMetadata:
        assert isinstance(other, SetMetadata)
        return SetMetadata(self.items | other.items)


@dataclass
class SaveMetadata(KVConnectorMetadata):
    """Blocks (chain hashes) the workers should save this step, per request."""

    saves: dict[str, list[bytes]] = field(default_factory=dict)
    block_size: int = 4


class WorkerEventsConnector(Recording):
    """Saves blocks on the workers and reports each store and eviction as an event.

    extra config: `medium` (default "DISK"), `capacity_blocks` (per-rank store size, LRU),
    `replication` (ranks 0..n-1 hold the blocks; default all), `lagging_rank` (that rank
    reports its events one step late), `async_save_steps` (saves of finished requests report
    done after that many worker steps; 0 = synchronous).
    """

    def __init__(self, context: KVConnectorContext, role: KVConnectorRole) -> None:
        super().__init__(context, role)
        self.medium: str = self.extra.get("medium", "DISK")
        self.replication: int = self.extra.get("replication", context.world_size)
        # scheduler half
        self.quorum = EventQuorum(
            context.world_size,
            required_ranks=self.replication,
            max_pending_steps=self.extra.get("max_pending_steps", 8),
        )
        # worker half
        self.store: OrderedDict[bytes, None] = OrderedDict()
        self._events: list[KVCacheEvent] = []
        self._held_back: list[KVCacheEvent] = []
        self._saving: dict[str, int] = {}
        self._finished_saves: set[str] = set()

    # scheduler half
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        super().build_connector_meta(scheduler_output)
        saves = {r.request_id: list(r.block_hashes) for r in scheduler_output.scheduled_new_reqs}
        return SaveMetadata(saves, self._context.block_size)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        meta = connector_output.kv_connector_worker_meta
        assert meta is None or isinstance(meta, KVEventsWorkerMetadata)
        self.quorum.update(meta)

    def take_events(self) -> list[KVCacheEvent]:
        return self.quorum.take_events()

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        is_async = self.extra.get("async_save_steps", 0) > 0
        return is_async, {f"saved_by_{self.medium}": len(request.block_hashes)}

    # worker half
    def wait_for_save(self) -> None:
        super().wait_for_save()
        meta = self._get_connector_metadata()
        assert isinstance(meta, SaveMetadata)
        if self._context.rank >= self.replication:
            return
        capacity = self.extra.get("capacity_blocks", 1 << 30)
        for hashes in meta.saves.values():
            new = [h for h in hashes if h not in self.store]
            for h in new:
                self.store[h] = None
            if new:
                wire: list[int | bytes] = [to_wire(h) for h in new]
                self._events.append(
                    BlockStored(wire, None, [], meta.block_size, None, self.medium, None)
                )
            while len(self.store) > capacity:
                evicted, _ = self.store.popitem(last=False)
                self._events.append(BlockRemoved([to_wire(evicted)], self.medium))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        steps = self.extra.get("async_save_steps", 0)
        if steps:
            for req_id in finished_req_ids:
                self._saving[req_id] = steps
        done = set()
        for req_id in list(self._saving):
            self._saving[req_id] -= 1
            if self._saving[req_id] <= 0:
                del self._saving[req_id]
                done.add(req_id)
        return done or None, None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return KVConnectorStats({"num_stored": len(self.store)})

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        events = self._held_back
        if self.extra.get("lagging_rank") == self._context.rank:
            events, self._held_back = self._held_back, self._events
        else:
            events, self._held_back = self._held_back + self._events, []
        self._events = []
        return KVEventsWorkerMetadata.from_rank(self._context.rank, events) if events else None


class SchedulerEventsConnector(Recording):
    """Learns of stores on the scheduler side: announces every finished request's blocks."""

    def __init__(self, context: KVConnectorContext, role: KVConnectorRole) -> None:
        super().__init__(context, role)
        self._events: list[KVCacheEvent] = []

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        wire: list[int | bytes] = [to_wire(h) for h in request.block_hashes]
        self._events.append(
            BlockStored(
                wire, None, list(request.all_token_ids), self._context.block_size, None, "CPU", None
            )
        )
        return False, None

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events


def transfer_config(name: str, **extra: Any) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector=name,
        kv_role="kv_both",
        kv_connector_module_path=MODULE,
        kv_connector_extra_config=extra,
    )


def multi_config(*children: KVTransferConfig) -> KVTransferConfig:
    dicts = [
        {
            "kv_connector": c.kv_connector,
            "kv_connector_module_path": c.kv_connector_module_path,
            "kv_connector_extra_config": c.kv_connector_extra_config,
        }
        for c in children
    ]
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": dicts},
    )


def roundtrip(obj: Any) -> Any:
    """What crossing a process boundary does to an object."""
    return pickle.loads(pickle.dumps(obj))


def layers_forward(layers: tuple[str, ...]) -> Any:
    """A forward pass without a model: the per-layer connector hooks, in layer order."""

    def forward(hooks: ConnectorLayerHooks) -> None:
        for layer in layers:
            hooks.before_attention(layer)
            hooks.after_attention(layer, None)

    return forward


class StepLoop:
    """vLLM's step order over one scheduler-role and `world_size` worker-role connectors."""

    LAYERS = ("model.layers.0", "model.layers.1")

    def __init__(self, config: KVTransferConfig, world_size: int, block_size: int = 4) -> None:
        def ctx(rank: int) -> KVConnectorContext:
            return KVConnectorContext(
                config, world_size=world_size, rank=rank, block_size=block_size
            )

        self.block_size = block_size
        self.scheduler = KVConnectorFactory.create_connector(ctx(0), KVConnectorRole.SCHEDULER)
        self.workers = [
            KVConnectorFactory.create_connector(ctx(r), KVConnectorRole.WORKER)
            for r in range(world_size)
        ]
        for w in self.workers:
            w.register_kv_caches({name: None for name in self.LAYERS})
        self.aggregator = KVOutputAggregator.from_connector(self.scheduler, world_size)
        self.finished_sending: set[str] = set()
        self.params: dict[str, dict[str, Any] | None] = {}
        self._next_block = 0

    def step(
        self,
        new: list[FakeRequest] = (),
        finished: list[FakeRequest] = (),  # type: ignore[assignment]
    ) -> list[KVCacheEvent]:
        """One step; returns the connector events the scheduler would publish."""
        sched = self.scheduler
        out = SchedulerOutput()
        for req in new:
            num_tokens, _ = sched.get_num_new_matched_tokens(req, 0)
            n = len(req.all_token_ids) // self.block_size
            ids = list(range(self._next_block, self._next_block + n))
            self._next_block += n
            sched.update_state_after_alloc(req, ids, num_tokens or 0)
            out.scheduled_new_reqs.append(
                NewRequestData(req.request_id, req.all_token_ids, req.block_hashes, ids)
            )
            out.num_scheduled_tokens[req.request_id] = len(req.all_token_ids)
        for req in finished:
            _, self.params[req.request_id] = sched.request_finished(req, [])
            out.finished_req_ids.add(req.request_id)
        meta = sched.build_connector_meta(out)
        outputs: list[KVConnectorOutput | None] = []
        for w in self.workers:
            _, output = run_worker_step(
                w, roundtrip(meta), out.finished_req_ids, layers_forward(self.LAYERS)
            )
            outputs.append(roundtrip(output))
        aggregated = self.aggregator.aggregate(outputs)
        sched.update_connector_output(aggregated)
        self.finished_sending |= aggregated.finished_sending or set()
        return list(sched.take_events())
