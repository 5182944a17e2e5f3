"""kvconnect: KV-cache connectors and vLLM-compatible KV cache events.

`LLM`, `SamplingParams` and `RequestOutput` are imported on first use, so that `import
kvconnect.hashing` (the router does) never pulls in torch.
"""

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "kvconnect.engine.llm",
    "SamplingParams": "kvconnect.engine.request",
    "RequestOutput": "kvconnect.engine.request",
    "CompletionOutput": "kvconnect.engine.request",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvconnect' has no attribute {name!r}")


__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
