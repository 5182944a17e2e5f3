"""Model shapes: `ModelConfig`, the built-in `tiny` model, reading a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvconnect.tokenizer import BYTE_EOS

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder's shape (Hugging Face names)."""

    vocab_size: int
    """Rows of the embedding and of the LM head."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    num_hidden_layers: int
    """Decoder layers."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key/value heads (grouped-query attention when fewer than query heads)."""
    head_dim: int = 0
    """Per-head width; 0 means hidden_size // num_attention_heads."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 10_000.0
    """RoPE base."""
    max_position_embeddings: int = 4096
    """Longest sequence the model takes."""
    tie_word_embeddings: bool = False
    """The LM head reuses the embedding matrix."""
    attention_bias: bool = False
    """q/k/v projections carry a bias (Qwen2)."""
    eos_token_id: int | None = None
    """Generation stops at this token unless asked not to."""
    architecture: str = "LlamaForCausalLM"
    """Hugging Face architecture name."""

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"ModelConfig.num_key_value_heads={self.num_key_value_heads}: must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"ModelConfig.architecture={self.architecture!r}: supported are "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )

    def check_tensor_parallel(self, tp: int) -> None:
        """`ValueError` unless heads, KV heads and the MLP split evenly over `tp` ranks."""
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            value = getattr(self, name)
            if value % tp:
                raise ValueError(f"tensor_parallel_size={tp} does not divide {name}={value}")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """From a Hugging Face config.json (Llama or Qwen2)."""
        archs = hf.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"config.json architectures={archs!r}: supported are "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        scaling = hf.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise ValueError(f"config.json rope_scaling={scaling!r}: only plain RoPE is supported")
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in hf.items() if k in names}
        kwargs.setdefault("num_key_value_heads", hf["num_attention_heads"])
        if kwargs.get("head_dim") is None:
            kwargs.pop("head_dim", None)
        eos = hf.get("eos_token_id")
        kwargs["eos_token_id"] = eos[0] if isinstance(eos, list) else eos
        kwargs["architecture"] = arch
        if arch == "Qwen2ForCausalLM":
            kwargs["attention_bias"] = True
        return cls(**kwargs)


# Byte-level vocabulary: 256 bytes, then BOS and EOS.
TINY = ModelConfig(
    vocab_size=258,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=8192,
    eos_token_id=BYTE_EOS,
)
