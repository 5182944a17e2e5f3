"""kvconnect inside a real vLLM: `OffloadConnector` (see `connector.py`), which vLLM loads by
name once kvconnect is installed beside it (`plugin.py` registers it), or through
`"kv_connector_module_path": "kvconnect.vllm"`.

Only this package imports vLLM; nothing else in kvconnect does. Its connector is imported on
first use, so that vLLM's plugin hook (`plugin.register`, run in every vLLM process) stays light.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "OffloadConnector":
        from kvconnect.vllm.connector import OffloadConnector

        return OffloadConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["OffloadConnector"]
