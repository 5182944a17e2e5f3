"""Building a rank's model shard: the built-in `tiny` model or a local Hugging Face checkpoint.

A checkpoint directory holds config.json, *.safetensors and tokenizer.json (Llama or Qwen2).
Each rank reads only its slice of each sharded tensor:

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

from kvconnect.model.config import TINY, ModelConfig
from kvconnect.model.llama import LlamaForCausalLM
from kvconnect.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

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
    with torch.no_grad():
        for name, param in model.named_parameters():
            tensor = read(name, shard_dim(name), rank, tp)
            if tensor.shape != param.shape:
                raise ValueError(
                    f"weight {name}: shape {tuple(tensor.shape)} on rank {rank}, expected "
                    f"{tuple(param.shape)}"
                )
            param.copy_(tensor)


def load_model(
    model: str, rank: int = 0, tp: int = 1, dtype: str = "float32", seed: int = 0
) -> tuple[LlamaForCausalLM, Tokenizer]:
    """Rank `rank`'s shard of `model` ("tiny" or a checkpoint directory) and its tokenizer."""
    torch_dtype = _resolve_dtype(dtype)
    if model == "tiny":
        full = tiny_state_dict(TINY, seed)
        llm = LlamaForCausalLM(TINY, tp)

        def read_tiny(name: str, dim: int | None, r: int, n: int) -> torch.Tensor:
            t = full[name]
            return t if dim is None else t.chunk(n, dim)[r]

        _fill(llm, read_tiny, rank, tp)
        return llm.to(torch_dtype).eval(), ByteTokenizer()
    return load_checkpoint(Path(model), rank, tp, torch_dtype)


def load_model_info(model: str) -> tuple[ModelConfig, Tokenizer]:
    """The model's config and tokenizer without its weights (for the scheduler process)."""
    if model == "tiny":
        return TINY, ByteTokenizer()
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(f"model {model!r}: not 'tiny' and no config.json in that directory")
    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    return config, load_tokenizer(model, config.eos_token_id)


def load_checkpoint(
    path: Path, rank: int, tp: int, dtype: torch.dtype
) -> tuple[LlamaForCausalLM, Tokenizer]:
    from safetensors import safe_open

    if not (path / "config.json").is_file():
        raise ValueError(f"model {str(path)!r}: not 'tiny' and no config.json in that directory")
    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
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

    llm = LlamaForCausalLM(config, tp)
    _fill(llm, read, rank, tp)
    _, tokenizer = load_model_info(str(path))
    return llm.to(dtype).eval(), tokenizer
