#!/usr/bin/env bash
# Builds the two peers' environments of the peer suite (tests_peers/) in DIR (default .peers
# beside this repo's Makefile), each a venv of its own, never kvconnect's; a second run finds
# their stamps and returns at once:
#   DIR/vllm-router  vllm-router 0.1.17 and the exact dependency closure it was tested with
#                    (vllm-router-0.1.17.pins)
#   DIR/dynamo       ai-dynamo-runtime 1.6.1 (NVIDIA Dynamo's runtime, its standalone KV indexer
#                    `python -m dynamo.indexer`) and what that indexer imports: pydantic (and its
#                    closure) at the newest release the runtime admits (<=2.13.5). Its other
#                    declared need, uvloop, and pyzmq/msgspec (its in-process publisher path)
#                    are not imported by the indexer, so they are left out (dynamo-1.6.1.pins).
# Every package is installed from its pin without the resolver, so the closure is exactly the
# pins file. A stamp in each venv holds its pins file's hash: changing the pins rebuilds it.
# Needs only the package index; about 30 s on a 2-core machine.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
dir=${1:-$repo/.peers}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

# build NAME PINS CHECK ENTRY...: DIR/NAME from PINS unless its stamp matches; CHECK (python
# code) must then run in it, and so must `python ENTRY... --help` once it is built.
build() {
  local venv=$dir/$1 pins=$here/$2 check=$3
  local stamp=$venv/.kvconnect-peers-stamp want
  want=$(sha256sum "$pins" | cut -d' ' -f1)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$venv/bin/python" -c "$check"; then
    return
  fi
  echo "# building $venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --no-deps -r "$pins"
  "$venv/bin/python" -c "$check"
  "$venv/bin/python" "${@:4}" --help > /dev/null
  echo "$want" > "$stamp"
}

build vllm-router vllm-router-0.1.17.pins \
  'import vllm_router_rs, vllm_router.launch_router' -m vllm_router.launch_router
build dynamo dynamo-1.6.1.pins \
  'from dynamo.llm import run_kv_indexer' -m dynamo.indexer
echo "$dir/vllm-router $dir/dynamo"
