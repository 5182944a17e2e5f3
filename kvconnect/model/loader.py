"""Building a rank's model shard: the built-in `tiny` model, a GGUF file (`smollm2` is one,
see `model/gguf_weights.py`) or a Hugging Face checkpoint (config.json, *.safetensors,
tokenizer.json; Llama or Qwen2). Each rank keeps only its slice of each sharded tensor:

    q/k/v_proj (+bias), gate/up_proj   rows     [rank * n/tp, (rank+1) * n/tp)
    o_proj, down_proj                   columns  [rank * n/tp, (rank+1) * n/tp)
    everything else                     whole
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvconnect.model.config import TINY, ModelConfig
from kvconnect.model.gguf_weights import GGUFWeights
from kvconnect.model.llama import LlamaForCausalLM
from kvconnect.model.source import ModelKind, gguf_metadata, gguf_tensor_names, resolve_model
from kvconnect.model.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

_ROW_SHARDED = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "q_proj.bias",
    "k_proj.bias",
    "v_proj.bias",
    "gate_proj.weight",
    "up_proj.weight",
)
_COL_SHARDED = ("o_proj.weight", "down_proj.weight")
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def shard_dim(name: str) -> int | None:
    """The dimension `name` is split along across TP ranks; None if replicated."""
    if name.endswith(_ROW_SHARDED):
        return 0
    if name.endswith(_COL_SHARDED):
        return 1
    return None


def tiny_state_dict(config: ModelConfig = TINY, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full (unsharded) weights of the tiny model, the same in every process for a seed."""
    gen = torch.Generator().manual_seed(seed)
    reference = LlamaForCausalLM(config, tp=1)
    state = {}
    for name, param in reference.named_parameters():
        if name.endswith("norm.weight"):
            state[name] = torch.ones_like(param)
        else:
            state[name] = torch.randn(param.shape, generator=gen) * 0.05
    return state


def _resolve_dtype(dtype: str) -> torch.dtype:
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype={dtype!r}: valid are {', '.join(DTYPES)}") from None


def _fill(
    model: LlamaForCausalLM,
    read: Callable[[str, int | None, int, int], torch.Tensor],
    rank: int,
    tp: int,
) -> None:
    """Give every parameter of `model` (built on the meta device) its weight as read."""
    new: dict[int, nn.Parameter] = {}
    for name, param in model.named_parameters():  # a tied weight once
        tensor = read(name, shard_dim(name), rank, tp)
        if tensor.shape != param.shape:
            raise ValueError(
                f"weight {name}: shape {tuple(tensor.shape)} on rank {rank}, expected "
                f"{tuple(param.shape)}"
            )
        new[id(param)] = nn.Parameter(tensor.contiguous(), requires_grad=False)
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[key] = new[id(p)]


def load_model(
    model: str, rank: int = 0, tp: int = 1, dtype: str = "float32", seed: int = 0
) -> tuple[LlamaForCausalLM, Tokenizer]:
    """Rank `rank`'s shard of `model` ("tiny", "smollm2", a .gguf file or a checkpoint
    directory, see `model.source`) and its tokenizer."""
    torch_dtype = _resolve_dtype(dtype)
    config, tokenizer = load_model_info(model)
    config.check_tensor_parallel(tp)
    with torch.device("meta"):
        llm = LlamaForCausalLM(config, tp)
    source = resolve_model(model)
    if source.kind is ModelKind.TINY:
        full = tiny_state_dict(TINY, seed)

        def read_tiny(name: str, dim: int | None, r: int, n: int) -> torch.Tensor:
            t = full[name]
            return t if dim is None else t.chunk(n, dim)[r]

        _fill(llm, read_tiny, rank, tp)
    elif source.kind is ModelKind.GGUF:
        assert source.path is not None
        _fill(llm, GGUFWeights(source.path, config).read, rank, tp)
    else:
        assert source.path is not None
        _fill(llm, _safetensors_reader(source.path, config), rank, tp)
    llm = llm.to(torch_dtype).eval()
    llm.pack_weights()
    return llm, tokenizer


def load_model_info(model: str) -> tuple[ModelConfig, Tokenizer]:
    """The model's config and tokenizer without its weights (for the scheduler process)."""
    source = resolve_model(model)
    if source.kind is ModelKind.TINY:
        return TINY, ByteTokenizer()
    assert source.path is not None
    if source.kind is ModelKind.GGUF:
        has_head = "output.weight" in gguf_tensor_names(source.path)
        config = ModelConfig.from_gguf(gguf_metadata(source.path), has_head)
    else:
        config = ModelConfig.from_hf(json.loads((source.path / "config.json").read_text()))
    return config, load_tokenizer(model, config.eos_token_id)


def _safetensors_reader(
    path: Path, config: ModelConfig
) -> Callable[[str, int | None, int, int], torch.Tensor]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model {str(path)!r}: no *.safetensors files")
    handles: list[Any] = [safe_open(str(f), framework="pt") for f in files]
    where: dict[str, Any] = {key: h for h in handles for key in h.keys()}  # noqa: SIM118

    def read(name: str, dim: int | None, r: int, n: int) -> torch.Tensor:
        key = name
        if key not in where and name == "lm_head.weight" and config.tie_word_embeddings:
            key = "model.embed_tokens.weight"
        if key not in where:
            raise ValueError(f"checkpoint {str(path)!r} has no tensor {key!r}")
        if dim is None:
            whole: torch.Tensor = where[key].get_tensor(key)
            return whole
        sliced = where[key].get_slice(key)
        size = sliced.get_shape()[dim] // n
        index = (
            (slice(r * size, (r + 1) * size),)
            if dim == 0
            else (slice(None), slice(r * size, (r + 1) * size))
        )
        tensor: torch.Tensor = sliced[index]
        return tensor

    return read
