"""kvconnect's worker on caches vLLM 0.33 itself plans and allocates: its KV cache specs, its
`get_kv_cache_config_from_groups` (strides per KVCacheLayout), its `allocate_kv_cache` (the
per-layer views a connector's `register_kv_caches` gets), read by kvconnect/vllm/layout.py.
For every layout and spec kind: a known value per (layer, block, head, token, byte), save,
clear, load into other blocks, compare bytes; what it cannot store is refused in one line
naming the layer, the layout and the shape. Runs in the vLLM 0.33 environment
(tests_vllm/env033.sh); skipped under another vLLM."""

from __future__ import annotations

import dataclasses

import pytest
import torch

vllm = pytest.importorskip("vllm")
if not vllm.__version__.startswith("0.33."):
    pytest.skip(f"vLLM 0.33 only (this is {vllm.__version__})", allow_module_level=True)

from vllm.config import CacheConfig, DeviceConfig, VllmConfig  # noqa: E402
from vllm.config.kv_transfer import KVTransferConfig as VllmTransferConfig  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVQuantMode,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from kvconnect.config import KVTransferConfig  # noqa: E402
from kvconnect.connector.base import KVConnectorContext  # noqa: E402
from kvconnect.connector.offload.common import (  # noqa: E402
    ChunkInfo,
    LoadSpec,
    OffloadConfig,
    OffloadMetadata,
    SaveSpec,
    TierConfig,
)
from kvconnect.connector.offload.kinds import TierKind  # noqa: E402
from kvconnect.connector.offload.layout import LayoutError  # noqa: E402
from kvconnect.connector.offload.worker import OffloadWorker  # noqa: E402
from kvconnect.vllm.layout import paged_kv  # noqa: E402

BS, CHUNK, BLOCKS, LAYERS = 4, 8, 12, 3
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]

FULL = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=4, dtype=torch.bfloat16)
SPECS = {
    "full_bf16": FULL,
    "full_fp8": dataclasses.replace(
        FULL, dtype=torch.float8_e4m3fn, kv_quant_mode=KVQuantMode.FP8_PER_TENSOR
    ),
    # a sliding-window model under a connector without HMA: all blocks kept (vLLM 0.33)
    "full_sliding_window": dataclasses.replace(FULL, sliding_window=8),
    # as TritonAttentionBackend.customize_spec packs int8_per_token_head: data + 2 fp32 scales
    "int8_per_token_head": dataclasses.replace(
        FULL,
        dtype=torch.int8,
        kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD,
        state_content_bytes=(4 + 4) + 2 * 4,
    ),
    # as FlashInferBackend.customize_spec packs nvfp4: K and V as head slots
    "nvfp4_head_slots": dataclasses.replace(
        FULL,
        dtype=torch.uint8,
        kv_quant_mode=KVQuantMode.NVFP4,
        num_head_slots=4,
        state_content_bytes=6,
    ),
    "mla_bf16": MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=12, dtype=torch.bfloat16),
    "mla_fp8_ds": MLAAttentionSpec(
        block_size=BS, num_kv_heads=1, head_size=12, dtype=torch.uint8, cache_dtype_str="fp8_ds_mla"
    ),
}


def vllm_config(layout: str) -> VllmConfig:
    config = VllmConfig(
        cache_config=CacheConfig(block_size=BS),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=VllmTransferConfig(
            kv_connector="OffloadConnector",
            kv_role="kv_both",
            kv_connector_module_path="kvconnect.vllm",
        ),
    )
    config.cache_config.kv_cache_layout = layout  # what the engine core resolves at start
    return config


def allocate(
    layout: str, groups: list[KVCacheGroupSpec], kernel_block: int | None = None
) -> tuple[VllmConfig, object, dict[str, torch.Tensor]]:
    """vLLM's own plan and allocation of `groups` with BLOCKS blocks, in `layout`."""
    config = vllm_config(layout)
    per_block = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups)
    kv_cache_config = get_kv_cache_config_from_groups(config, groups, per_block * BLOCKS)
    assert kv_cache_config.num_blocks == BLOCKS or len(groups) > 1  # groups overlay
    kernel = None if kernel_block is None else [kernel_block] * len(groups)
    caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), KVCacheLayout[layout], kernel)
    return config, kv_cache_config, caches


def fill_known(caches: dict[str, torch.Tensor]) -> None:
    for layer, view in enumerate(caches.values()):
        b = view.view(torch.uint8)
        idx = [
            torch.arange(n).reshape([-1 if i == d else 1 for i in range(4)])
            for d, n in enumerate(b.shape)
        ]
        b.copy_(
            ((layer * 97 + idx[0] * 31 + idx[1] * 17 + idx[2] * 7 + idx[3]) % 251).to(torch.uint8)
        )


def blocks_of(view: torch.Tensor, ids: list[int]) -> torch.Tensor:
    b = view.view(torch.uint8)
    return b.view(BLOCKS, b.shape[0] // BLOCKS, *b.shape[1:])[torch.tensor(ids)]


def info() -> ChunkInfo:
    return ChunkInfo(b"\x01" * 32, (10, 11), None, tuple(range(CHUNK)), BS)


def round_trip(
    config: VllmConfig, kv_cache_config: object, caches: dict[str, torch.Tensor]
) -> None:
    """Save blocks [3, 7], clear the cache, load into [10, 1]: the same bytes, nothing else."""
    fill_known(caches)
    expected = {name: view.clone() for name, view in caches.items()}
    ctx = KVConnectorContext(
        KVTransferConfig(kv_connector="OffloadConnector", kv_role="kv_both"),
        world_size=1,
        rank=0,
        block_size=BS,
        model_name="m",
    )
    tiers = (TierConfig(kind=TierKind.CPU, max_bytes=1 << 20),)
    worker = OffloadWorker(ctx, OffloadConfig(block_size=BS, chunk_size=CHUNK, tiers=tiers))
    worker.register_paged_kv(paged_kv(caches, kv_cache_config, config, BS))
    try:
        worker.wait_for_save(OffloadMetadata(saves=[SaveSpec(info(), [3, 7])]))
        assert worker.drain()
        for view in caches.values():
            view.view(torch.uint8).zero_()
        worker.start_load_kv(OffloadMetadata(loads=[LoadSpec("r", [info()], [[10, 1]], [0])]))
        assert worker.drain()
        assert worker.get_finished() == (None, {"r"})
        assert worker.get_block_ids_with_load_errors() == set()
    finally:
        worker.shutdown()
    for name, view in caches.items():
        assert torch.equal(blocks_of(view, [10, 1]), blocks_of(expected[name], [3, 7])), name
        assert not blocks_of(view, [b for b in range(BLOCKS) if b not in (10, 1)]).any(), name


@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("layout", [m.name for m in KVCacheLayout])
def test_vllm_033_caches_come_back_byte_for_byte(layout: str, spec_name: str) -> None:
    round_trip(*allocate(layout, [KVCacheGroupSpec(NAMES, SPECS[spec_name])]))


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])  # vLLM splits layer-compact ones
def test_vllm_033_kernel_blocks(layout: str) -> None:
    config, kv_cache_config, caches = allocate(layout, [KVCacheGroupSpec(NAMES, FULL)], 2)
    assert next(iter(caches.values())).shape[0] == 2 * BLOCKS  # vLLM split each block in two
    round_trip(config, kv_cache_config, caches)


def test_vllm_033_nhd_alias_is_lbnhc() -> None:
    config, kv_cache_config, caches = allocate("LBNHC", [KVCacheGroupSpec(NAMES, FULL)])
    config.cache_config.kv_cache_layout = "NHD"
    round_trip(config, kv_cache_config, caches)


REFUSED = {
    "sliding_window": SlidingWindowSpec(
        block_size=BS, num_kv_heads=2, head_size=4, dtype=torch.float16, sliding_window=8
    ),
    "chunked_local_attention": ChunkedLocalAttentionSpec(
        block_size=BS, num_kv_heads=2, head_size=4, dtype=torch.float16, attention_chunk_size=8
    ),
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_kinds_it_cannot_store_are_refused_naming_layer_layout_and_shape(kind: str) -> None:
    config, kv_cache_config, caches = allocate("LBHNC", [KVCacheGroupSpec(NAMES, REFUSED[kind])])
    with pytest.raises(LayoutError) as e:
        paged_kv(caches, kv_cache_config, config, BS)
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith(
        f"kvconnect OffloadConnector: layer {NAMES[0]}: LBHNC {kind} cache of shape [12, 2, 4, 8]"
    )


def test_two_kv_cache_groups_are_refused() -> None:
    full = KVCacheGroupSpec(NAMES[:2], dataclasses.replace(FULL, dtype=torch.float16))
    window = KVCacheGroupSpec(NAMES[2:], REFUSED["sliding_window"])
    config, kv_cache_config, caches = allocate("BLHNC", [full, window])
    with pytest.raises(
        LayoutError,
        match=r"2 KV cache groups \[full_attention \(2 layers\), sliding_window \(1 layers\)\]",
    ):
        paged_kv(caches, kv_cache_config, config, BS)


def test_a_tensor_that_is_not_its_layout_is_refused() -> None:
    config, kv_cache_config, caches = allocate("LBNHC", [KVCacheGroupSpec(NAMES, FULL)])
    config.cache_config.kv_cache_layout = "LBHNC"  # the tensors are NHD, the config says HND
    with pytest.raises(
        LayoutError, match=rf"layer {NAMES[0]}: LBHNC full_attention .*strides do not follow LBHNC"
    ):
        paged_kv(caches, kv_cache_config, config, BS)
