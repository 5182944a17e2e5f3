"""kvconnect without vLLM: nothing outside `kvconnect.vllm` imports vLLM, and the plugin
package itself imports nothing from vLLM until vLLM asks for its connector; and what the plugin
relies on across the boundary: the offload connector's halves build the engine's own metadata
types, with every field of kvconnect's step metadata in them."""

import dataclasses
import pkgutil
import subprocess
import sys
from typing import Any

import torch

import kvconnect
from kvconnect.commands.redis_server import LocalRedis
from kvconnect.config import KVTransferConfig
from kvconnect.connector.base import KVConnectorContext
from kvconnect.connector.offload.common import (
    OffloadConfig,
    OffloadMetadata,
    OffloadWorkerMetadata,
)
from kvconnect.connector.offload.scheduler import OffloadScheduler
from kvconnect.connector.offload.worker import OffloadWorker
from kvconnect.engine.request import RequestStatus
from kvconnect.events import (
    MEDIUMS,
    TIER_CPU,
    TIER_STORAGE_REMOTE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    tier_of,
)
from kvconnect.hashing import block_hashes
from kvconnect.messages import (
    KVConnectorOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)
from tests.connector.helpers import roundtrip
from tests.helpers import free_port, wait_for


def test_no_module_outside_kvconnect_vllm_imports_vllm() -> None:
    names = [
        m.name
        for m in pkgutil.walk_packages(kvconnect.__path__, "kvconnect.")
        if not m.name.startswith("kvconnect.vllm")
    ]
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_plugin_package_and_hook_module_import_without_vllm() -> None:
    code = (
        "import sys, kvconnect.vllm, kvconnect.vllm.plugin\n"
        "assert 'vllm' not in sys.modules\n"
        "try:\n"
        "    kvconnect.vllm.OffloadConnector\n"
        "except ModuleNotFoundError as e:\n"
        "    assert e.name == 'vllm', e\n"
        "else:\n"
        "    raise AssertionError('vLLM is not installed here')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- the step metadata across the boundary ------------------------------------------------------
# The vLLM plugin gives both halves vLLM's own metadata types (kvconnect/vllm/adapter.py:
# OffloadMetadataForVllm, OffloadWorkerMetadataForVllm), and the halves build those directly.
# Here an engine of our own stands in for vLLM, with its own bases, as the plugin does.

BS, CHUNK = 4, 8


class EngineStepBase:
    """An engine's own base of the step metadata (vLLM: KVConnectorMetadata)."""


class EngineWorkerBase:
    """An engine's own base of the workers' metadata (vLLM: KVConnectorWorkerMetadata)."""


class EngineMetadata(OffloadMetadata, EngineStepBase):
    """What the plugin's OffloadMetadataForVllm is: kvconnect's fields, the engine's type."""


class EngineWorkerMetadata(OffloadWorkerMetadata, EngineWorkerBase):
    """What the plugin's OffloadWorkerMetadataForVllm is."""


def new_requests(*requests: tuple[str, list[int]]) -> SchedulerOutput:
    """A step that computes each request's whole prompt (blocks 0.. of the request)."""
    out = SchedulerOutput()
    for rid, tokens in requests:
        ids = list(range(-(-len(tokens) // BS)))
        out.scheduled_new_reqs.append(NewRequestData(rid, tokens, block_hashes(tokens, BS), ids))
        out.scheduled.append(ScheduledRequest(rid, tokens, 0, ids, sample=True))
    return out


class Req:
    """What the scheduler half reads of a waiting request."""

    def __init__(self, rid: str, tokens: list[int], params: dict[str, Any] | None = None) -> None:
        self.request_id, self.all_token_ids = rid, tokens
        self.block_hashes = block_hashes(tokens, BS)
        self.cache_salt = None
        self.kv_transfer_params = params
        self.status = RequestStatus.FINISHED_LENGTH


class Halves:
    """The offload connector's two halves built with the engine's metadata classes (one TP
    rank), driven in the engine's step order; every metadata crosses by pickle, as vLLM
    sends it to and from its worker processes."""

    def __init__(self, tiers: list[dict[str, Any]], peer: dict[str, Any] | None = None) -> None:
        context = KVConnectorContext(KVTransferConfig(), block_size=BS, model_name="m")
        extra: dict[str, Any] = {"chunk_size": CHUNK, "tiers": tiers}
        if peer is not None:
            extra["peer"] = peer
        config = OffloadConfig.from_extra_config(extra, BS)
        self.scheduler = OffloadScheduler(context, config, EngineMetadata)
        self.worker = OffloadWorker(context, config, EngineWorkerMetadata)
        self.worker.register_kv_caches({"layer0": torch.randn(2, 16, BS, 2, 4)})
        self.events: list[KVCacheEvent] = []

    def step(self, out: SchedulerOutput | None = None) -> OffloadMetadata:
        meta = roundtrip(self.scheduler.build_connector_meta(out or SchedulerOutput()))
        self.worker.start_load_kv(meta)
        self.worker.wait_for_save(meta)
        assert self.worker.drain()
        reported = roundtrip(self.worker.build_connector_worker_meta())
        assert reported is None or type(reported) is EngineWorkerMetadata
        self.scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=reported))
        self.events += self.scheduler.take_events()
        return meta

    def count(self, kind: type[KVCacheEvent], tier: str) -> int:
        """Events of `kind` in `tier` ("STORAGE/REMOTE"), said in vLLM 0.33's words (the
        older DISK and EXTERNAL never match)."""
        return sum(
            isinstance(e, kind)
            and e.medium in MEDIUMS  # type: ignore[union-attr]
            and tier_of(e.medium, e.locality) == tier  # type: ignore[union-attr]
            for e in self.events
        )

    def step_until_redis_drops_one(self) -> None:
        """Idle steps until the scheduler announced that Redis dropped a chunk (its ttl)."""

        def dropped() -> bool:
            self.step()
            return self.count(BlockRemoved, TIER_STORAGE_REMOTE) > 0

        wait_for(dropped, interval=0.02, what="redis never expired the chunk")

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


def test_every_field_of_the_step_metadata_reaches_the_worker_in_the_engines_type(
    fresh_redis: LocalRedis,
) -> None:
    a, c = list(range(9)), list(range(50, 59))  # one whole chunk each
    halves = Halves(
        [
            {"kind": "cpu", "max_bytes": 1 << 20},
            {"kind": "redis", "url": fresh_redis.url, "ttl_s": 0.2},
        ],
        peer={"port": free_port()},
    )
    try:
        halves.step(new_requests(("a", a)))
        assert (
            halves.count(BlockStored, TIER_CPU)
            == halves.count(BlockStored, TIER_STORAGE_REMOTE)
            == 1
        )
        halves.step_until_redis_drops_one()
        # One step with all of it: a load (b finds a's chunk in the cpu tier), saves (c's
        # chunk, and the tail of a's answer: a finished request's last save), a reset, the
        # chunk Redis dropped, and a lease (a finished as a P/D prefill).
        b = Req("b", a)
        sched = halves.scheduler
        answered = [*a, 9, 10, 11, 12]  # its 12 computed tokens: a tail of one block
        hold, params = sched.request_finished(
            Req("a", answered, {"do_remote_decode": True}), [0, 1, 2]
        )
        assert hold and params is not None
        assert sched.get_num_new_matched_tokens(b, 0) == (CHUNK, False)  # cpu tier: sync
        sched.update_state_after_alloc(b, [7, 8, 9], CHUNK)
        assert sched.reset_cache()
        meta = roundtrip(sched.build_connector_meta(new_requests(("c", c))))
        assert type(meta) is EngineMetadata
        assert meta.shared_gone == [block_hashes(a, BS)[1]]
        assert meta.reset is True
        assert [(x.lease_id, x.last_block_hashes) for x in meta.leases] == [
            ("a", [block_hashes(a, BS)[1]])
        ]
        assert [(s.request_id, s.block_ids, s.first_block, s.sync) for s in meta.loads] == [
            ("b", [[7, 8]], [0], True)
        ]
        assert [(s.chunk.last_block_hash, s.block_ids) for s in meta.saves] == [
            (block_hashes(answered, BS)[2], [2]),
            (block_hashes(c, BS)[1], [0, 1]),
        ]
        assert meta.finished_saves == ["a"]
        # Every field is set here, so one the engine's type dropped would show (a field added
        # later must be set above too), but `idle`: a step with a save computes something.
        empty = OffloadMetadata()
        unset = [
            f.name
            for f in dataclasses.fields(OffloadMetadata)
            if getattr(meta, f.name) == getattr(empty, f.name)
        ]
        assert unset == ["idle"]
        idle = roundtrip(sched.build_connector_meta(SchedulerOutput()))
        assert type(idle) is EngineMetadata and idle.idle is True
    finally:
        halves.close()


def test_a_chunk_redis_dropped_is_written_again_by_its_next_save(fresh_redis: LocalRedis) -> None:
    """The worker learns from the step metadata's `shared_gone` that Redis no longer holds a
    chunk it wrote; without it, the worker would skip the chunk as written, for good."""
    a = list(range(9))
    halves = Halves([{"kind": "redis", "url": fresh_redis.url, "ttl_s": 0.2}])
    try:
        halves.step(new_requests(("a", a)))
        assert halves.count(BlockStored, TIER_STORAGE_REMOTE) == 1
        halves.step_until_redis_drops_one()
        meta = halves.step(new_requests(("a2", a)))
        assert meta.shared_gone == [block_hashes(a, BS)[1]] and len(meta.saves) == 1
        assert halves.count(BlockStored, TIER_STORAGE_REMOTE) == 2  # written and announced again
    finally:
        halves.close()
