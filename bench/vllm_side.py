"""The vLLM half of the vLLM benchmarks: a script runs itself again in `.vllm/venv` (where
vLLM is installed, never in the project's venv) and reads back one marked JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".vllm" / "venv" / "bin" / "python"
VLLM_MODEL = ROOT / ".vllm" / "smollm2-135m"
MARK = "kvconnect-bench-result:"  # vLLM logs to stdout too
FLAG = "--vllm-side"


def built() -> bool:
    """Whether `make test-vllm` has built the vLLM environment and the model."""
    return VLLM_PYTHON.exists() and VLLM_MODEL.exists()


def inside() -> bool:
    """Whether this process is the vLLM side."""
    return FLAG in sys.argv


def report(result: dict[str, Any]) -> None:
    """On the vLLM side: hand `result` back."""
    print(MARK, json.dumps(result), flush=True)


def run(script: str, timeout: float, args: list[str] | None = None) -> dict[str, Any] | str:
    """Run `script` on the vLLM side (vLLM's CPU settings of the recipe), with `args`: its
    result, or a one-line reason it failed."""
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }
    done = subprocess.run(
        [str(VLLM_PYTHON), script, FLAG, *(args or [])],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(MARK)]
    if done.returncode != 0 or not lines:
        return f"failed: {done.stderr.strip().splitlines()[-3:]}"
    result: dict[str, Any] = json.loads(lines[0].removeprefix(MARK))
    return result
