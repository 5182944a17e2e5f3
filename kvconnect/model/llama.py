"""A Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged KV cache.

Module names follow Hugging Face (`model.layers.N.self_attn.q_proj`, ...) so checkpoints load by
name. With tensor parallelism each rank holds `heads / tp` query heads, `kv_heads / tp` KV heads
and `intermediate / tp` MLP columns; the outputs of `o_proj` and `down_proj` are summed across
ranks (all-reduce). Embedding, norms and LM head are replicated.

A step runs a flat batch: the new tokens of every scheduled request, one after another.

    tokens    [ r0: t t t t | r1: t | r2: t t ]      (T tokens; query_lens = [4, 1, 2])
    slots      where each token's K/V goes in the cache (block_id * block_size + offset)
    per request: attend to its cache context through its block table (context_lens)

Paged KV cache of one layer (this rank's shard): [2, num_blocks, block_size, kv_heads, head_dim]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvconnect.model.config import ModelConfig


@dataclass
class AttentionMetadata:
    """Where a step's tokens come from and go to."""

    query_lens: list[int]
    """New tokens per request, in batch order."""
    context_lens: list[int]
    """Tokens in the cache per request once this step's are written (computed + new)."""
    block_tables: list[list[int]]
    """Each request's block ids, in sequence order."""
    slot_mapping: torch.Tensor
    """Cache slot of every new token, [T] int64."""
    block_size: int

    def __post_init__(self) -> None:
        self._decode: DecodeBatch | bool | None = False  # False: not built yet

    def decode_batch(self) -> DecodeBatch | None:
        """The step's single-token (decode) rows as one padded batch, built once per step and
        shared by every layer; None when fewer than two rows decode."""
        if self._decode is False:
            self._decode = DecodeBatch.build(self)
        return self._decode if isinstance(self._decode, DecodeBatch) else None


@dataclass
class DecodeBatch:
    """The decode rows of a step, laid out for one attention call over all of them.

    Each row's block table is padded to the longest (with block 0, masked out), so a row's
    keys are `cache[block_tables[b]]` flattened, valid up to its context length.
    """

    token_index: torch.Tensor
    """Where each decode row's query sits in the step's flat batch, [B] int64."""
    requests: list[int]
    """Indices (into the step's requests) of the decode rows."""
    block_tables: torch.Tensor
    """[B, max_blocks] int64."""
    mask: torch.Tensor
    """[B, 1, 1, max_blocks * block_size] bool: True where a key is in the row's context."""

    @staticmethod
    def build(meta: AttentionMetadata) -> DecodeBatch | None:
        rows, starts, start = [], [], 0
        for i, n in enumerate(meta.query_lens):
            if n == 1 and meta.context_lens[i] > 1:
                rows.append(i)
                starts.append(start)
            start += n
        if len(rows) < 2:
            return None
        bs = meta.block_size
        ctx = [meta.context_lens[i] for i in rows]
        width = (max(ctx) + bs - 1) // bs
        tables = torch.zeros(len(rows), width, dtype=torch.long)
        for b, i in enumerate(rows):
            used = meta.block_tables[i][: (ctx[b] + bs - 1) // bs]
            tables[b, : len(used)] = torch.tensor(used, dtype=torch.long)
        keys = torch.arange(width * bs)
        mask = (keys[None, :] < torch.tensor(ctx)[:, None])[:, None, None, :]
        return DecodeBatch(torch.tensor(starts, dtype=torch.long), rows, tables, mask)


class Linear(nn.Linear):
    """`nn.Linear` that, once `pack()`ed, multiplies through oneDNN with its weight reordered
    for it (on CPU, float32). Torch's own CPU matmul goes through MKL, which takes a slow path
    on AMD processors. Measured on this project's EPYC (AVX2) machines, SmolLM2's shapes:
    the LM head at 16 rows 54 -> 17 ms, at 1 row 11.4 -> 6.0 ms; the MLP's up projection at 16
    rows 2.1 -> 0.9 ms; decode at batch 16 56 -> 100 tok/s (`bench/vllm_cpu.py`). vLLM's CPU
    backend prepacks its weights for oneDNN too. The weight itself stays (checkpoints, tied
    embeddings), the packed copy beside it.
    """

    packed: torch.Tensor | None = None

    def pack(self) -> None:
        w = self.weight
        if w.device.type != "cpu" or w.dtype != torch.float32 or not _HAS_ONEDNN:
            return
        try:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 16)
        except RuntimeError:  # a build without the op's kernels: torch's own path
            self.packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.packed, self.bias, "none", [], ""
        )
        return out


_HAS_ONEDNN: bool = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]


class LayerHooks(Protocol):
    """Called around each layer's attention (the worker's KV connector)."""

    def before_attention(self, layer_name: str) -> None: ...
    def after_attention(self, layer_name: str, kv_cache: torch.Tensor) -> None: ...


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [T, head_dim] (the half-split layout Hugging Face Llama uses)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def paged_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """Attention of each request's new queries over its cached context.

    q: [T, heads, head_dim]; kv_cache: [2, num_blocks, block_size, kv_heads, head_dim].
    Query i of a request with n new tokens and context c sits at position c - n + i and sees
    keys 0..c - n + i.
    """
    out = torch.empty_like(q)
    decode = meta.decode_batch()
    batched = set(decode.requests) if decode is not None else set()
    if decode is not None:
        out[decode.token_index] = decode_attention(q[decode.token_index], kv_cache, decode)
    start = 0
    bs = meta.block_size
    for i, (n, ctx, table) in enumerate(
        zip(meta.query_lens, meta.context_lens, meta.block_tables, strict=True)
    ):
        if i in batched:
            start += n
            continue
        blocks = torch.tensor(table[: (ctx + bs - 1) // bs], dtype=torch.long)
        # [1, heads, len, d]: with a batch dimension CPU torch picks its flash kernel (5x
        # faster here than the math path it takes for 3-D inputs).
        k = kv_cache[0, blocks].flatten(0, 1)[:ctx].transpose(0, 1).unsqueeze(0)
        v = kv_cache[1, blocks].flatten(0, 1)[:ctx].transpose(0, 1).unsqueeze(0)
        qi = q[start : start + n].transpose(0, 1).unsqueeze(0)
        if n == ctx:  # a whole prompt: plain causal
            o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, enable_gqa=True)
        elif n == 1:  # decode: the last position sees everything
            o = F.scaled_dot_product_attention(qi, k, v, enable_gqa=True)
        else:  # a later chunk: causal, aligned to the end of the context
            q_pos = torch.arange(ctx - n, ctx)[:, None]
            mask = torch.arange(ctx)[None, :] <= q_pos  # [n, ctx]
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, enable_gqa=True)
        out[start : start + n] = o[0].transpose(0, 1)
        start += n
    return out


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, decode: DecodeBatch) -> torch.Tensor:
    """One attention call for all decode rows. q: [B, heads, head_dim] -> the same shape.

    The padded keys past a row's context are masked; a row's output is its own context's
    softmax-weighted values, as the per-request call computes it (up to fp32 summation order).
    """
    b, kv_heads, d = q.shape[0], kv_cache.shape[3], kv_cache.shape[4]
    k = kv_cache[0, decode.block_tables].view(b, -1, kv_heads, d).transpose(1, 2)
    v = kv_cache[1, decode.block_tables].view(b, -1, kv_heads, d).transpose(1, 2)
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=decode.mask, enable_gqa=True
    )  # [B, heads, 1, d]
    return o.squeeze(2)


AllReduce = Callable[[torch.Tensor], torch.Tensor]


def dist_all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, tp: int, layer_name: str) -> None:
        super().__init__()
        self.tp = tp
        self.all_reduce: AllReduce = dist_all_reduce
        self.layer_name = layer_name
        self.num_heads = config.num_attention_heads // tp
        self.num_kv_heads = config.num_key_value_heads // tp
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        hd, bias = config.head_dim, config.attention_bias
        self.q_proj = Linear(config.hidden_size, self.num_heads * hd, bias=bias)
        self.k_proj = Linear(config.hidden_size, self.num_kv_heads * hd, bias=bias)
        self.v_proj = Linear(config.hidden_size, self.num_kv_heads * hd, bias=bias)
        self.o_proj = Linear(self.num_heads * hd, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        hooks: LayerHooks | None,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = apply_rope(self.q_proj(x).view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if hooks is not None:
            hooks.before_attention(self.layer_name)  # an external load may fill the cache
        flat = kv_cache.view(2, -1, self.num_kv_heads, self.head_dim)
        flat[0].index_copy_(0, meta.slot_mapping, k)
        flat[1].index_copy_(0, meta.slot_mapping, v)
        o = paged_attention(q, kv_cache, meta)
        if hooks is not None:
            hooks.after_attention(self.layer_name, kv_cache)
        out: torch.Tensor = self.o_proj(o.reshape(t, -1))
        return self.all_reduce(out) if self.tp > 1 else out


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: int) -> None:
        super().__init__()
        self.tp = tp
        self.all_reduce: AllReduce = dist_all_reduce
        inter = config.intermediate_size // tp
        self.gate_proj = Linear(config.hidden_size, inter, bias=False)
        self.up_proj = Linear(config.hidden_size, inter, bias=False)
        self.down_proj = Linear(inter, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = F.silu(self.gate_proj(x)) * self.up_proj(x)
        out: torch.Tensor = self.down_proj(h)
        return self.all_reduce(out) if self.tp > 1 else out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: int, index: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, tp, f"model.layers.{index}.self_attn")  # layer_names
        self.mlp = MLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        hooks: LayerHooks | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, hooks)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class _Backbone(nn.Module):
    def __init__(self, config: ModelConfig, tp: int) -> None:
        super().__init__()
        # Built on the meta device and filled by the loader: no initial values. (An
        # Embedding's own init, normal_ on a meta tensor, imports torch._dynamo: 1.4 s.)
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, tp, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """This rank's shard of the model."""

    def __init__(self, config: ModelConfig, tp: int = 1) -> None:
        super().__init__()
        config.check_tensor_parallel(tp)
        self.config = config
        self.tp = tp
        self.model = _Backbone(config, tp)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def pack_weights(self) -> None:
        """Reorder every projection's weight for oneDNN (`Linear`), once loaded."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()

    def set_all_reduce(self, all_reduce: AllReduce) -> None:
        """Sum partial outputs across TP ranks with `all_reduce` (default: torch.distributed)."""
        for module in self.modules():
            if isinstance(module, Attention | MLP):
                module.all_reduce = all_reduce

    @property
    def layer_names(self) -> list[str]:
        return [f"model.layers.{i}.self_attn" for i in range(self.config.num_hidden_layers)]

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's paged KV cache on this rank."""
        kv_heads = self.config.num_key_value_heads // self.tp
        return (2, num_blocks, block_size, kv_heads, self.config.head_dim)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        hooks: LayerHooks | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta, hooks)
        normed: torch.Tensor = self.model.norm(x)
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(hidden)
        return logits.float()
