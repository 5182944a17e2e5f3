"""Model shapes: `ModelConfig`, the built-in `tiny` model, reading a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvconnect.model.tokenizer import BYTE_EOS

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
        """From a Hugging Face config.json (Llama or Qwen2), of either generation: RoPE as a
        top-level `rope_theta` / `rope_scaling`, or transformers 5's `rope_parameters`.

        A key that would change the model's math and that this engine does not implement
        (RoPE scaling, sliding windows, other activations, biases it has not got) is a
        `ValueError`, and so is any key it does not know at all: never a silent default.
        """
        archs = hf.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"config.json architectures={archs!r}: supported are "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        unknown = sorted(set(hf) - _HF_MATH_KEYS - _HF_INERT_KEYS)
        if unknown:
            raise ValueError(
                f"config.json: key(s) {', '.join(unknown)} not understood by this engine; they "
                "may change the model's math, so the checkpoint is refused"
            )
        _refuse_unless(hf, "hidden_act", ("silu",))
        _refuse_unless(hf, "mlp_bias", (False,))
        _refuse_unless(hf, "use_sliding_window", (False,))
        _refuse_unless(hf, "partial_rotary_factor", (1, 1.0))
        _refuse_unless(hf, "quantization_config", ())
        if arch == "LlamaForCausalLM":
            _refuse_unless(hf, "attention_bias", (False,))  # Llama's would bias o_proj too
        layer_types = hf.get("layer_types") or []
        if any(kind != "full_attention" for kind in layer_types):
            raise ValueError(
                f"config.json layer_types {sorted(set(layer_types))}: only full attention "
                "layers are supported by this engine"
            )
        kwargs = {k: hf[k] for k in _MODEL_FIELDS if k in hf}
        kwargs["rope_theta"] = _rope_theta(hf)
        kwargs.setdefault("num_key_value_heads", hf["num_attention_heads"])
        if kwargs.get("head_dim") is None:
            kwargs.pop("head_dim", None)
        eos = hf.get("eos_token_id")
        kwargs["eos_token_id"] = eos[0] if isinstance(eos, list) else eos
        kwargs["architecture"] = arch
        kwargs["attention_bias"] = arch == "Qwen2ForCausalLM"  # q/k/v biases
        return cls(**kwargs)

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], has_output_weight: bool) -> ModelConfig:
        """From a GGUF file's metadata (llama.cpp's keys). `has_output_weight`: the file has
        its own LM head (else it is tied to the embedding)."""
        arch = meta.get("general.architecture")
        if arch not in _GGUF_ARCHITECTURES:
            supported = ", ".join(_GGUF_ARCHITECTURES)
            raise ValueError(f"GGUF general.architecture={arch!r}: supported are {supported}")
        for key in meta:
            if key.startswith(f"{arch}.rope.scaling.") and meta[key] not in ("none", 1, 1.0, 0):
                raise ValueError(f"GGUF {key}={meta[key]!r}: only plain RoPE is supported")
            if key in (f"{arch}.attention.sliding_window", f"{arch}.expert_count"):
                raise ValueError(f"GGUF {key}={meta[key]!r} is not supported by this engine")

        def need(key: str) -> Any:
            if f"{arch}.{key}" not in meta:
                raise ValueError(f"GGUF file has no {arch}.{key}")
            return meta[f"{arch}.{key}"]

        heads = need("attention.head_count")
        hidden = need("embedding_length")
        head_dim = meta.get(f"{arch}.attention.key_length", hidden // heads)
        if meta.get(f"{arch}.rope.dimension_count", head_dim) != head_dim:
            raise ValueError(
                f"GGUF {arch}.rope.dimension_count={meta[f'{arch}.rope.dimension_count']}: "
                f"partial rotary embeddings (head_dim {head_dim}) are not supported"
            )
        vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
        return cls(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=need("feed_forward_length"),
            num_hidden_layers=need("block_count"),
            num_attention_heads=heads,
            num_key_value_heads=meta.get(f"{arch}.attention.head_count_kv", heads),
            head_dim=head_dim,
            rms_norm_eps=need("attention.layer_norm_rms_epsilon"),
            rope_theta=meta.get(f"{arch}.rope.freq_base", 10_000.0),
            max_position_embeddings=meta.get(f"{arch}.context_length", 4096),
            tie_word_embeddings=not has_output_weight,
            attention_bias=arch == "qwen2",
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
            architecture=_GGUF_ARCHITECTURES[arch],
        )


_MODEL_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
)
# Keys that shape the math: each is either read into ModelConfig or checked to be a value this
# engine computes (see from_hf).
_HF_MATH_KEYS = {
    *_MODEL_FIELDS,
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "hidden_act",
    "mlp_bias",
    "attention_bias",
    "use_sliding_window",
    "sliding_window",  # only used with use_sliding_window
    "max_window_layers",  # ditto
    "partial_rotary_factor",
    "quantization_config",
    "layer_types",
    "architectures",
    "eos_token_id",
}
# Keys that do not change what a forward pass computes.
_HF_INERT_KEYS = {
    "model_type",
    "dtype",
    "torch_dtype",
    "transformers_version",
    "bos_token_id",
    "pad_token_id",
    "unk_token_id",
    "initializer_range",
    "use_cache",
    "attention_dropout",  # inference
    "pretraining_tp",  # a training-time slicing of the same matmuls
    "_name_or_path",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "tie_encoder_decoder",
    "is_encoder_decoder",
    "id2label",
    "label2id",
}
_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def _refuse_unless(hf: dict[str, Any], key: str, allowed: tuple[Any, ...]) -> None:
    if key in hf and hf[key] is not None and hf[key] not in allowed:
        raise ValueError(f"config.json {key}={hf[key]!r} is not supported by this engine")


def _rope_theta(hf: dict[str, Any]) -> float:
    """The RoPE base from either config.json generation; anything but plain RoPE is refused."""
    params = hf.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise ValueError(f"config.json rope_parameters={params!r}: expected an object")
        extra = sorted(set(params) - {"rope_type", "rope_theta"})
        if params.get("rope_type", "default") != "default" or extra:
            raise ValueError(
                f"config.json rope_parameters={params!r}: only plain RoPE is supported"
            )
        if "rope_theta" not in params:
            raise ValueError("config.json rope_parameters has no rope_theta")
        if "rope_theta" in hf and hf["rope_theta"] != params["rope_theta"]:
            raise ValueError("config.json gives two different rope_theta values")
        return float(params["rope_theta"])
    scaling = hf.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ValueError(f"config.json rope_scaling={scaling!r}: only plain RoPE is supported")
    return float(hf.get("rope_theta", 10_000.0))


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
