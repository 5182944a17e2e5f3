"""kvconnect: KV-cache connectors and vLLM-compatible KV cache events.

`LLM`, `SamplingParams`, `StructuredOutputsParams` and `RequestOutput` are imported on first
use, so that `import kvconnect.hashing` (the router does) never pulls in torch.

Modules that moved in 0.2 (`kvconnect.publisher` is now `kvconnect.stream.publisher`, ...; the
table is `_MOVED`) still import under their old names, with a `DeprecationWarning`, for one
release.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "kvconnect.engine.llm",
    "SamplingParams": "kvconnect.engine.request",
    "RequestOutput": "kvconnect.engine.request",
    "CompletionOutput": "kvconnect.engine.request",
    "StructuredOutputsParams": "kvconnect.engine.structured_output",
}


_MOVED = {
    "kvconnect.publisher": "kvconnect.stream.publisher",
    "kvconnect.subscriber": "kvconnect.stream.subscriber",
    "kvconnect.stream_state": "kvconnect.stream.state",
    "kvconnect.server": "kvconnect.serve.server",
    "kvconnect.engine_loop": "kvconnect.serve.engine_loop",
    "kvconnect.serve_metrics": "kvconnect.serve.metrics",
    "kvconnect.generate": "kvconnect.commands.generate",
    "kvconnect.cluster": "kvconnect.commands.cluster",
    "kvconnect.events_tool": "kvconnect.commands.events",
    "kvconnect.startup": "kvconnect.commands.startup",
    "kvconnect.redis_server": "kvconnect.commands.redis_server",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a moved module's old name as its new module, warning once per name."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = _MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; the old name goes away in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        return None


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())  # before the path finders: the old files are gone


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvconnect' has no attribute {name!r}")


__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]
