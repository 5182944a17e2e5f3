"""kvconnect: KV-cache connectors and vLLM-compatible KV cache events."""

__version__ = "0.1.0"
