"""Every KV cache layout vLLM 0.33 can hand a connector, through kvconnect's views
(`connector/offload/layout.py`) and a real worker with a real cpu tier: the cache is allocated
as vLLM 0.33 allocates it on CPU (one int8 buffer, a stride permutation of the logical
[L, B, H, N, C] shape, per-layer views in the cache dtype), a known value is written per
(layer, block, token, head, byte), the chunk is saved, the cache cleared, the chunk loaded
into other blocks, and the bytes compared. The same views from vLLM 0.33's own objects:
tests_vllm/v033/test_layouts.py."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass

import pytest
import torch

from kvconnect.config import KVTransferConfig
from kvconnect.connector.base import KVConnectorContext
from kvconnect.connector.offload.common import (
    ChunkInfo,
    LoadSpec,
    OffloadConfig,
    OffloadMetadata,
    PeerConfig,
    SaveSpec,
    TierConfig,
)
from kvconnect.connector.offload.kinds import TierKind
from kvconnect.connector.offload.layout import LayoutError, PagedKV, from_kv_planes, from_logical
from kvconnect.connector.offload.peers.protocol import RecvBuffers
from kvconnect.connector.offload.tiers.cpu import CpuTier
from kvconnect.connector.offload.worker import OffloadWorker
from kvconnect.events import BlockRemoved, BlockStored
from tests.helpers import free_port

BS, CHUNK, BLOCKS, LAYERS = 4, 8, 12, 3

LAYOUTS = {  # vLLM 0.33's KVCacheLayout members: physical order of the logical L, B, H, N, C
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


@dataclass(frozen=True)
class Spec:
    """A layer's KV cache spec as the views need it: head slots, content elements per
    (token, head) and their dtype, and the K width when the content is K then V."""

    heads: int
    content: int
    dtype: torch.dtype
    kv_width: int | None


SPECS = {
    "full_bf16": Spec(2, 8, torch.bfloat16, 4),  # K and V of 4: two planes
    "full_fp32": Spec(3, 4, torch.float32, 2),
    "full_fp8_e4m3": Spec(2, 8, torch.float8_e4m3fn, 4),
    "full_fp8_e5m2": Spec(2, 8, torch.float8_e5m2, 4),  # a dtype tiers cannot name: bytes
    "int8_per_token_head": Spec(2, 4 + 4 + 8, torch.int8, None),  # two fp32 scales inline
    "nvfp4_head_slots": Spec(4, 6, torch.uint8, None),  # K and V as head slots, packed
    "mla_latent": Spec(1, 12, torch.bfloat16, None),  # one latent (+ rope) per token
    "kv_two_widths": Spec(2, 4 + 2, torch.float16, None),  # K 4, V 2: one run
}


def allocate_like_vllm(
    order: tuple[int, ...], spec: Spec, kernel_blocks: int = 1
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the raw buffer, per-layer views [B * R, H, N / R, C]), as vLLM 0.33's
    `allocate_kv_cache` makes them: byte strides from the layout's permutation."""
    esize = torch.empty((), dtype=spec.dtype).element_size()
    shape = (LAYERS, BLOCKS * kernel_blocks, spec.heads, BS // kernel_blocks, spec.content * esize)
    strides = [0] * 5
    step = 1
    for dim in reversed(order):
        strides[dim] = step
        step *= shape[dim]
    raw = torch.zeros(step, dtype=torch.int8)
    logical = torch.as_strided(raw, shape, strides)
    return raw, [logical[layer].view(spec.dtype) for layer in range(LAYERS)]


def byte_view(view: torch.Tensor) -> torch.Tensor:
    return view.view(torch.uint8)


def fill_known(views: list[torch.Tensor]) -> None:
    """Each (layer, block, head, token, byte) gets a value made of all five indices."""
    for layer, view in enumerate(views):
        b = byte_view(view)
        idx = [
            torch.arange(n).reshape([-1 if i == d else 1 for i in range(4)])
            for d, n in enumerate(b.shape)
        ]
        value = layer * 97 + idx[0] * 31 + idx[1] * 17 + idx[2] * 7 + idx[3]
        # fp8 bytes are any bit pattern (a NaN pattern is still just bytes to the copies)
        b.copy_((value % 251).to(torch.uint8))


def info(i: int) -> ChunkInfo:
    return ChunkInfo(bytes([i]) * 32, (i * 10, i * 10 + 1), None, tuple(range(CHUNK)), BS)


def make_worker() -> OffloadWorker:
    cfg = KVTransferConfig(kv_connector="OffloadConnector", kv_role="kv_both")
    ctx = KVConnectorContext(cfg, world_size=1, rank=0, block_size=BS, model_name="m")
    tiers = (TierConfig(kind=TierKind.CPU, max_bytes=1 << 20),)
    return OffloadWorker(ctx, OffloadConfig(block_size=BS, chunk_size=CHUNK, tiers=tiers))


def save_clear_load(
    worker: OffloadWorker, raw: torch.Tensor, src: list[int], dst: list[int], first: int = 0
) -> None:
    worker.wait_for_save(OffloadMetadata(saves=[SaveSpec(info(1), src)]))
    assert worker.drain()
    raw.zero_()
    worker.start_load_kv(OffloadMetadata(loads=[LoadSpec("r", [info(1)], [dst], [first])]))
    assert worker.drain()
    assert worker.get_finished() == (None, {"r"})
    assert worker.get_block_ids_with_load_errors() == set()


def blocks_of(view: torch.Tensor, ids: list[int], kernel_blocks: int) -> torch.Tensor:
    """The blocks' bytes, [len(ids), R, H, N, C], from a per-layer view."""
    b = byte_view(view)
    return b.view(BLOCKS, kernel_blocks, *b.shape[1:])[torch.tensor(ids)]


def check_moved(
    expected: list[torch.Tensor],
    views: list[torch.Tensor],
    src: list[int],
    dst: list[int],
    kernel_blocks: int = 1,
) -> None:
    for want, got in zip(expected, views, strict=True):
        assert torch.equal(blocks_of(got, dst, kernel_blocks), blocks_of(want, src, kernel_blocks))
        others = [b for b in range(BLOCKS) if b not in dst]
        assert not blocks_of(got, others, kernel_blocks).any()  # nothing else written


@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_chunk_comes_back_byte_for_byte_in_other_blocks(layout: str, spec_name: str) -> None:
    spec = SPECS[spec_name]
    raw, views = allocate_like_vllm(LAYOUTS[layout], spec)
    fill_known(views)
    expected = [v.clone() for v in views]
    paged = PagedKV.from_views(
        {
            f"l{i}": from_logical(f"l{i}", v, BLOCKS, spec.kv_width, layout)
            for i, v in enumerate(views)
        }
    )
    worker = make_worker()
    worker.register_paged_kv(paged)
    try:
        save_clear_load(worker, raw, [3, 7], [10, 1])
        check_moved(expected, views, [3, 7], [10, 1])
        assert worker.tiers[0].check_integrity() is None
    finally:
        worker.shutdown()


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_kernel_blocks_inside_a_block_keep_their_token_order(layout: str) -> None:
    """vLLM splits a block into kernel blocks its attention takes (here 2 of 2 tokens)."""
    spec = SPECS["full_bf16"]
    raw, views = allocate_like_vllm(LAYOUTS[layout], spec, kernel_blocks=2)
    fill_known(views)
    expected = [v.clone() for v in views]
    paged = PagedKV.from_views(
        {
            f"l{i}": from_logical(f"l{i}", v, BLOCKS, spec.kv_width, layout)
            for i, v in enumerate(views)
        }
    )
    assert paged.block_size == BS
    worker = make_worker()
    worker.register_paged_kv(paged)
    try:
        save_clear_load(worker, raw, [0, 5], [6, 11])
        check_moved(expected, views, [0, 5], [6, 11], kernel_blocks=2)
    finally:
        worker.shutdown()


def bf16_blnhc_worker() -> tuple[
    torch.Tensor, list[torch.Tensor], list[torch.Tensor], OffloadWorker
]:
    """A bf16 BLNHC cache filled with known values, a copy of them, and a worker on it."""
    spec = SPECS["full_bf16"]
    raw, views = allocate_like_vllm(LAYOUTS["BLNHC"], spec)
    fill_known(views)
    expected = [v.clone() for v in views]
    paged = PagedKV.from_views(
        {
            f"l{i}": from_logical(f"l{i}", v, BLOCKS, spec.kv_width, "BLNHC")
            for i, v in enumerate(views)
        }
    )
    worker = make_worker()
    worker.register_paged_kv(paged)
    return raw, views, expected, worker


def test_a_partial_load_leaves_the_computed_leading_block_alone() -> None:
    raw, views, expected, worker = bf16_blnhc_worker()
    try:
        save_clear_load(worker, raw, [2, 4], [8, 9], first=1)
        check_moved(expected, views, [4], [9])
    finally:
        worker.shutdown()


def test_nhd_and_hnd_engines_store_the_same_chunk_bytes() -> None:
    """The chunk is canonical: an HND engine reads what an NHD engine wrote."""
    spec = SPECS["full_bf16"]
    chunks = []
    for layout in ("LBNHC", "BHLNC"):
        _, views = allocate_like_vllm(LAYOUTS[layout], spec)
        for layer, v in enumerate(views):  # the same logical values in both
            byte_view(v).copy_(
                torch.arange(byte_view(v).numel()).reshape(byte_view(v).shape) % 241 + layer
            )
        paged = PagedKV.from_views(
            {f"l{i}": from_logical(f"l{i}", v, BLOCKS, 4, layout) for i, v in enumerate(views)}
        )
        chunks.append(paged.gather([1, 2]))
    assert chunks[0].shape == (LAYERS, 2, CHUNK, 2, 4)
    assert torch.equal(chunks[0].view(torch.uint8), chunks[1].view(torch.uint8))


def test_kvconnect_engine_planes_layout_round_trips() -> None:
    gen = torch.Generator().manual_seed(0)
    caches = {f"l{i}": torch.randn(2, BLOCKS, BS, 2, 4, generator=gen) for i in range(2)}
    expected = {k: v.clone() for k, v in caches.items()}
    worker = make_worker()
    worker.register_kv_caches(caches)
    try:
        worker.wait_for_save(OffloadMetadata(saves=[SaveSpec(info(1), [0, 1])]))
        assert worker.drain()
        worker.start_load_kv(OffloadMetadata(loads=[LoadSpec("r", [info(1)], [[5, 6]], [0])]))
        assert worker.drain()
        for name, cache in caches.items():
            assert torch.equal(cache[:, [5, 6]], expected[name][:, [0, 1]])
    finally:
        worker.shutdown()


def test_layers_sharing_one_cache_are_stored_once() -> None:
    _, views = allocate_like_vllm(LAYOUTS["LBNHC"], SPECS["full_bf16"])
    shared = {"a": views[0], "b": views[1], "b_shared": views[1]}  # vLLM's KV sharing
    paged = PagedKV.from_views(
        {k: from_logical(k, v, BLOCKS, 4, "LBNHC") for k, v in shared.items()}
    )
    assert paged.names == ("a", "b")


def test_a_layer_of_another_shape_is_refused_by_name() -> None:
    _, a = allocate_like_vllm(LAYOUTS["LBNHC"], SPECS["full_bf16"])
    _, b = allocate_like_vllm(LAYOUTS["LBNHC"], SPECS["mla_latent"])
    views = {"x.0": from_logical("x.0", a[0], BLOCKS, 4, "LBNHC")}
    views["x.1"] = from_logical("x.1", b[0], BLOCKS, None, "LBNHC")
    with pytest.raises(
        LayoutError,
        match=r"^kvconnect OffloadConnector: layer x\.1: .*"
        r"shape \[12, 1, 4, 1, 1, 12\].*differs from layer x\.0",
    ):
        PagedKV.from_views(views)


def test_shapes_that_are_not_a_layout_are_refused_in_one_line() -> None:
    with pytest.raises(LayoutError, match=r"layer k: \[2, blocks.*shape \[3, 4, 4, 2, 4\]") as e:
        from_kv_planes("k", torch.zeros(3, 4, 4, 2, 4))
    assert "\n" not in str(e.value)
    with pytest.raises(
        LayoutError, match=r"layer k: LBNHC cache of shape \[10, 2, 4, 8\].*12 blocks"
    ):
        from_logical("k", torch.zeros(10, 2, 4, 8), BLOCKS, 4, "LBNHC")
    with pytest.raises(LayoutError, match="content is not contiguous"):
        from_logical("k", torch.zeros(12, 2, 8, 4).transpose(2, 3), BLOCKS, 4, "LBNHC")


def test_a_cache_with_another_block_size_is_refused() -> None:
    _, views = allocate_like_vllm(LAYOUTS["LBNHC"], SPECS["full_bf16"])
    paged = PagedKV.from_views({"l": from_logical("l", views[0][:, :, :2], BLOCKS, 4, "LBNHC")})
    with pytest.raises(ValueError, match="2-token blocks, the engine's block size is 4"):
        make_worker().register_paged_kv(paged)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_chunk_holds_k_then_v_per_token_and_head(layout: str) -> None:
    """chunk[layer, plane, token, head] is the logical cache's (block, head, token) K or V."""
    _, views = allocate_like_vllm(LAYOUTS[layout], SPECS["full_fp32"])
    fill_known(views)
    paged = PagedKV.from_views(
        {f"l{i}": from_logical(f"l{i}", v, BLOCKS, 2, layout) for i, v in enumerate(views)}
    )
    chunk = paged.gather([9, 2])
    for layer, view in enumerate(views):
        for t in range(CHUNK):
            block = [9, 2][t // BS]
            for head in range(3):
                assert torch.equal(chunk[layer, 0, t, head], view[block, head, t % BS, :2])
                assert torch.equal(chunk[layer, 1, t, head], view[block, head, t % BS, 2:])


def test_cpu_attn_k_rows_then_v_rows_are_the_k_and_v_planes() -> None:
    """CPU_ATTN (LBHNC only) reads a (block, head) as N K rows then N V rows."""
    raw, views = allocate_like_vllm(LAYOUTS["LBHNC"], SPECS["full_fp32"])
    fill_known(views)
    expected = [v.clone() for v in views]
    paged = PagedKV.from_views(
        {
            f"l{i}": from_logical(f"l{i}", v, BLOCKS, 2, "LBHNC", kv_rows=True)
            for i, v in enumerate(views)
        }
    )
    chunk = paged.gather([4])
    rows = views[1][4].reshape(3, 2, BS, 2)  # [H, K/V, N, D] as CPU_ATTN's chunk(2, dim=2)
    assert torch.equal(chunk[1, 0], rows[:, 0].transpose(0, 1))
    assert torch.equal(chunk[1, 1], rows[:, 1].transpose(0, 1))
    worker = make_worker()
    worker.register_paged_kv(paged)
    try:
        save_clear_load(worker, raw, [4, 0], [2, 3])
        check_moved(expected, views, [4, 0], [2, 3])
    finally:
        worker.shutdown()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_runs_of_consecutive_blocks_and_gaps_move_as_one_index_copy_would(layout: str) -> None:
    """gather and scatter copy run by run (slices, not index kernels): for ids in runs, with
    gaps and out of order, the chunk is what index_select reads and the cache what
    index_copy_ writes; an id outside the cache is refused before anything is written."""
    _, views = allocate_like_vllm(LAYOUTS[layout], SPECS["full_fp32"])
    fill_known(views)
    paged = PagedKV.from_views(
        {f"l{i}": from_logical(f"l{i}", v, BLOCKS, 2, layout) for i, v in enumerate(views)}
    )
    ids = [4, 5, 6, 1, 9, 10, 0]
    index = torch.tensor(ids)
    chunk = paged.gather(ids)
    for layer, got in zip(paged.layers, chunk, strict=True):
        want = layer.index_select(0, index).permute(4, 0, 1, 2, 3, 5)
        assert torch.equal(got, want.reshape(got.shape))
    expected = [layer.clone() for layer in paged.layers]
    new = torch.randn_like(chunk)
    for want, src in zip(expected, new, strict=True):
        _, r, n, h, p, d = want.shape
        want.index_copy_(0, index, src.reshape(p, len(ids), r, n, h, d).permute(1, 2, 3, 4, 0, 5))
    paged.scatter(ids, new)
    assert all(torch.equal(a, b) for a, b in zip(paged.layers, expected, strict=True))
    before = [layer.clone() for layer in paged.layers]
    for bad in ([2, BLOCKS], [-1, 0]):
        with pytest.raises(IndexError, match="outside the cache"):
            paged.scatter(bad, new[:, :, : 2 * BS])
    assert all(torch.equal(a, b) for a, b in zip(paged.layers, before, strict=True))


def test_a_sync_load_is_done_when_start_load_kv_returns_and_is_never_reported() -> None:
    """A load wholly from the cpu tier (LoadSpec.sync) fills its blocks before start_load_kv
    returns (the step's forward computes the rest next) and is not an async finish; after
    shutdown, one returns at once as a load error."""
    raw, views, expected, worker = bf16_blnhc_worker()
    try:
        worker.wait_for_save(OffloadMetadata(saves=[SaveSpec(info(1), [3, 7])]))
        assert worker.drain()
        raw.zero_()
        load = LoadSpec("r", [info(1)], [[10, 1]], [0], sync=True)
        worker.start_load_kv(OffloadMetadata(loads=[load]))  # no drain: done on return
        check_moved(expected, views, [3, 7], [10, 1])
        assert worker.get_finished() == (None, None)
        assert worker.get_block_ids_with_load_errors() == set()
    finally:
        worker.shutdown()
    worker.start_load_kv(
        OffloadMetadata(loads=[LoadSpec("s", [info(1)], [[4, 5]], [0], sync=True)])
    )
    assert worker.get_block_ids_with_load_errors() == {4, 5}
    assert worker.get_finished() == (None, None)


def test_a_workers_cpu_tier_copies_out_what_it_evicts_only_with_a_tier_below() -> None:
    """Demotion needs the evicted data; with no local tier below it, it would be a 12 MB
    copy into fresh memory per eviction (its page faults showed on every pull)."""
    cfg = KVTransferConfig(kv_connector="OffloadConnector", kv_role="kv_both")
    ctx = KVConnectorContext(cfg, world_size=1, rank=0, block_size=BS, model_name="m")
    spec = SPECS["full_bf16"]
    _, views = allocate_like_vllm(LAYOUTS["BLNHC"], spec)
    paged = PagedKV.from_views(
        {
            f"l{i}": from_logical(f"l{i}", v, BLOCKS, spec.kv_width, "BLNHC")
            for i, v in enumerate(views)
        }
    )
    with tempfile.TemporaryDirectory() as d:
        for tiers, keeps in (
            ((TierConfig(kind=TierKind.CPU, max_bytes=1 << 20),), False),
            (
                (
                    TierConfig(kind=TierKind.CPU, max_bytes=1 << 20),
                    TierConfig(kind=TierKind.DISK, path=d, max_bytes=1 << 22),
                ),
                True,
            ),
        ):
            worker = OffloadWorker(ctx, OffloadConfig(block_size=BS, chunk_size=CHUNK, tiers=tiers))
            try:
                worker.register_paged_kv(paged)
                cpu = worker.tiers[0]
                assert isinstance(cpu, CpuTier) and cpu.keep_evicted is keeps
            finally:
                worker.shutdown()


class CountingBuffers(RecvBuffers):
    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.taken: list[str] = []

    def take(self, key: str, n: int) -> memoryview | None:
        self.taken.append(key)
        return super().take(key, n)


def test_a_pulled_chunk_is_received_into_a_cpu_slot_and_a_refused_one_gives_its_slot_back() -> None:
    """Worker B pulls four chunks and a tail from worker A's peer server (real sockets, real
    tiers). Each whole chunk lands straight in a slot of B's two-slot cpu tier, which then
    holds it with no copy (the receive buffers are used by the tail only), evicting as a put
    would; the chunk A forged (another prompt's tokens under its key) is refused, its blocks
    reported for recompute, its slot given back; every slot is accounted for after."""
    cfg = KVTransferConfig(kv_connector="OffloadConnector", kv_role="kv_both")
    ctx = KVConnectorContext(cfg, world_size=1, rank=0, block_size=BS, model_name="m")
    gen = torch.Generator().manual_seed(1)
    source = {f"l{i}": torch.randn(2, BLOCKS, BS, 2, 4, generator=gen) for i in range(2)}
    target = {k: torch.zeros_like(v) for k, v in source.items()}
    slot_bytes = 2 * 2 * CHUNK * 2 * 4 * 4  # layers, K/V, tokens, heads, dim, fp32
    workers = []
    for max_bytes in (1 << 20, 2 * slot_bytes):
        peer = PeerConfig(port=free_port(), timeout_s=5.0)
        tiers = (TierConfig(kind=TierKind.CPU, max_bytes=max_bytes),)
        workers.append(
            OffloadWorker(
                ctx, OffloadConfig(block_size=BS, chunk_size=CHUNK, tiers=tiers, peer=peer)
            )
        )
    a, b = workers
    try:
        a.register_kv_caches(source)
        b.register_kv_caches(target)
        tail = ChunkInfo(b"t" * 32, (99,), 3 * 10 + 1, tuple(range(BS)), BS)
        saves = [SaveSpec(info(i), [2 * i - 2, 2 * i - 1]) for i in (1, 2, 3)]
        a.wait_for_save(OffloadMetadata(saves=[*saves, SaveSpec(tail, [6])]))
        assert a.drain()
        cpu_a = a.tiers[0]
        forged = ChunkInfo(bytes([4]) * 32, (40, 41), None, tuple(range(1, CHUNK + 1)), BS)
        cpu_a.put(a._key(info(4)), forged, source["l0"].new_zeros(cpu_a.chunk_shape))  # type: ignore[attr-defined]
        b.build_connector_worker_meta()  # nothing yet
        counting = CountingBuffers(slot_bytes)
        assert b.peers is not None
        b.peers.make_buffers = lambda _: counting
        chunks = [info(1), info(2), info(3), info(4), tail]
        blocks = [[0, 1], [2, 3], [4, 5], [8, 9], [6]]
        peer_at = ("127.0.0.1", a.config.peer.port)  # type: ignore[union-attr]
        b.start_load_kv(
            OffloadMetadata(
                loads=[LoadSpec("r", chunks, blocks, [0] * 5, source=peer_at, from_source=0)]
            )
        )
        assert b.drain()
        assert b.get_finished() == (None, {"r"})
        assert b.get_block_ids_with_load_errors() == {8, 9}  # the forged chunk: recomputed
        for name, kv in source.items():
            assert torch.equal(target[name][:, :7], kv[:, :7])
            assert not target[name][:, 7:].any()
        assert counting.taken == [b._key(tail)]  # whole chunks went straight to slots
        cpu = b.tiers[0]
        assert isinstance(cpu, CpuTier) and cpu.num_slots == 2
        cpu.check_integrity()  # the forged chunk's slot is free again, none is lost
        held = [k for k, _ in cpu.entries()]
        assert held == [b._key(info(3)), b._key(tail)]
        found = cpu.load(b._key(info(3)))
        assert found is not None and torch.equal(found.data, a.tiers[0].load(a._key(info(3))).data)  # type: ignore[union-attr]
        meta = b.build_connector_worker_meta()
        assert meta is not None
        events = meta.events_by_rank[0]
        stored = [e.block_hashes[-1] for e in events if isinstance(e, BlockStored)]
        removed = [e.block_hashes[-1] for e in events if isinstance(e, BlockRemoved)]
        assert len(stored) == 4 and len(removed) == 2  # 1..3 and the tail in; 1 and 2 out
        stats = b.get_kv_connector_stats()
        assert stats is not None
        assert stats.data["peer_hits"] == 4 and stats.data["num_peer_integrity_misses"] == 1
    finally:
        for w in workers:
            w.shutdown()
