#!/usr/bin/env bash
# Builds the environment of the vLLM 0.33 scheduler harness (tests_vllm/v033, run by
# `make test-vllm`), in DIR (default .vllm033 beside this repo's Makefile), once; a second run
# checks it and returns:
#   DIR/venv   vLLM 0.33.0 (its CUDA wheel, installed --no-deps: only the Python modules are
#              used, on CPU torch), the pinned closure its scheduler, KV cache manager and KV
#              connectors import (vllm-0.33.0.pins, no resolver), kvconnect (editable) and pytest
# The harness needs SmolLM2's HF directory as its model config: env.sh builds it (DIR/smollm2-135m
# of the 0.32 environment). Needs only the package index, and torch 2.13.0's CPU wheel where pip
# finds it (PIP_FIND_LINKS): any other torch is a multi-GB CUDA build, which this script refuses.
# vLLM's compiled kernels are never loaded (no `import vllm._C`: they are CUDA builds).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
dir=${1:-$repo/.vllm033}
venv=$dir/venv
py=$venv/bin/python
mkdir -p "$dir/wheels"

check='import torch, vllm; assert vllm.__version__ == "0.33.0", vllm.__version__; \
assert not torch.version.cuda, "torch is not the CPU build"; \
import vllm.v1.core.sched.scheduler, vllm.distributed.kv_transfer.kv_connector.v1.multi_connector, \
kvconnect.vllm.connector, xxhash, redis, pytest, pytest_timeout'


if ! [ -x "$py" ] || ! "$py" -c "$check" 2>/dev/null; then
  echo "# building $venv (about 2 minutes)"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$py" -m pip install -q "torch==2.13.0"
  "$py" -c 'import sys, torch; sys.exit("torch is not the CPU build" if torch.version.cuda else 0)'
  "$py" -m pip install -q --no-deps -r "$here/vllm-0.33.0.pins"
  "$py" -m pip download -q --no-deps -d "$dir/wheels" vllm==0.33.0
  "$py" -m pip install -q --no-deps "$dir"/wheels/vllm-0.33.0-*.whl
  "$py" -m pip install -q --no-deps -e "$repo"
  "$py" "$here/missing_deps.py" "$repo/pyproject.toml"  # kvconnect's own, --no-deps
  "$py" -c "$check"
fi
"$py" "$here/missing_deps.py" "$repo/pyproject.toml"  # as in env.sh
echo "$venv"
