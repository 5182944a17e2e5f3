"""A rank's weight shard from a GGUF file, dequantized, under Hugging Face names.

    token_embd.weight                 -> model.embed_tokens.weight
    output_norm.weight                -> model.norm.weight
    output.weight                     -> lm_head.weight (absent: tied to the embedding)
    blk.N.attn_norm.weight            -> model.layers.N.input_layernorm.weight
    blk.N.ffn_norm.weight             -> model.layers.N.post_attention_layernorm.weight
    blk.N.attn_{q,k,v}.{weight,bias}  -> model.layers.N.self_attn.{q,k,v}_proj.*
    blk.N.attn_output.weight          -> model.layers.N.self_attn.o_proj.weight
    blk.N.ffn_{gate,up,down}.weight   -> model.layers.N.mlp.{gate,up,down}_proj.weight

llama.cpp's converter reorders the rows of a Llama q/k projection within each head, from
Hugging Face's half-split RoPE layout to interleaved pairs; `_unpermute` puts them back:

    one head's rows, Hugging Face:  x0 x1 .. x(d/2-1) | y0 y1 .. y(d/2-1)
    the same rows in the GGUF:      x0 y0 x1 y1 .. x(d/2-1) y(d/2-1)

(Qwen2 files keep Hugging Face's order.) Tensors are dequantized with the `gguf` package to
float32, then cast to the engine's dtype by the caller.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from kvconnect.model.config import ModelConfig
from kvconnect.model.source import gguf_file

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")


def gguf_name(hf_name: str) -> str:
    """The GGUF tensor that holds the Hugging Face parameter `hf_name`."""
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    m = _LAYER_NAME.fullmatch(hf_name)
    if m is None or m.group(2) not in _LAYER:
        raise ValueError(f"no GGUF tensor for parameter {hf_name!r}")
    return f"blk.{m.group(1)}.{_LAYER[m.group(2)]}"


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of q/k rows (see the module docstring)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFWeights:
    """Reads Hugging Face-named, TP-sharded tensors out of one GGUF file."""

    def __init__(self, path: Path, config: ModelConfig) -> None:
        import gguf

        self.path = path
        self.config = config
        self._tensors = gguf_file(path).tensors
        self._permuted = config.architecture == "LlamaForCausalLM"
        bad = sorted(
            f"{t.name} ({t.tensor_type.name})"
            for t in self._tensors.values()
            if t.tensor_type.name not in SUPPORTED_TYPES
        )
        if bad:
            raise ValueError(
                f"{path}: tensor type(s) not supported: {', '.join(bad[:4])}"
                f"{' ...' if len(bad) > 4 else ''}; supported: {', '.join(SUPPORTED_TYPES)}"
            )
        self._dequantize = gguf.quants.dequantize

    def read(self, hf_name: str, dim: int | None, rank: int, tp: int) -> torch.Tensor:
        """Rank `rank`'s slice (along `dim`, of `tp`) of parameter `hf_name`, as float32."""
        name = gguf_name(hf_name)
        if name == "output.weight" and name not in self._tensors:
            name = "token_embd.weight"  # tied
        tensor = self._tensors.get(name)
        if tensor is None:
            raise ValueError(f"{self.path}: no tensor {name!r} (for {hf_name})")
        data = tensor.data
        if dim == 0:
            # A quantization block never crosses a row: the rank's rows dequantize alone.
            size = data.shape[0] // tp
            data = data[rank * size : (rank + 1) * size]
        w = np.asarray(self._dequantize(data, tensor.tensor_type), dtype=np.float32)
        if self._permuted and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = (
                self.config.num_attention_heads
                if name.endswith("attn_q.weight")
                else self.config.num_key_value_heads
            )
            # A row shard holds whole heads, and the interleaving stays within a head.
            w = _unpermute(w, heads // tp if dim == 0 else heads)
        if dim == 1:
            size = w.shape[1] // tp
            w = w[:, rank * size : (rank + 1) * size]
        if not w.flags.writeable or not w.flags.c_contiguous:  # a view of the read-only file
            w = np.array(w, dtype=np.float32)
        return torch.from_numpy(w)
