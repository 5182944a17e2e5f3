"""The Llama-style model, its configs, weight loading and tokenizers."""

from kvconnect.model.config import TINY, ModelConfig
from kvconnect.model.llama import AttentionMetadata, LlamaForCausalLM, paged_attention
from kvconnect.model.loader import load_model

__all__ = [
    "TINY",
    "AttentionMetadata",
    "LlamaForCausalLM",
    "ModelConfig",
    "load_model",
    "paged_attention",
]
