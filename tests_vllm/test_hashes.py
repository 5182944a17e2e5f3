"""kvconnect's block hashes against vLLM's own code, for every algorithm and seed rule.

vLLM resolves its seed from the environment when it initialises NONE_HASH, so each case runs in
a fresh interpreter with that environment and hashes the same requests both ways there.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

from kvconnect.hashing import ALGORITHMS

BOTH_WAYS = r"""
import json, sys
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as u
from vllm.v1.request import Request
from kvconnect.hashing import block_hashes, to_wire

block_size = 32
tokens = [(7 * i + 3) % 49152 for i in range(200)]
cases = {
    "plain": {},
    "salted": {"cache_salt": "tenant-a"},
    "empty salt": {"cache_salt": ""},
    "lora": {"lora_request": LoRARequest("sql", 1, "/adapters/sql")},
}
out = {}
for algorithm in sys.argv[1:]:
  fn = get_hash_fn_by_name(algorithm)
  u.init_none_hash(fn)  # NONE_HASH from this process's environment, as vLLM's engine does
  for name, kwargs in cases.items():
    req = Request(
        name, tokens, SamplingParams(max_tokens=1), None,
        block_hasher=u.get_request_block_hasher(block_size, fn), **kwargs,
    )
    lora = kwargs.get("lora_request")
    mine = block_hashes(
        tokens, block_size, algorithm=algorithm, cache_salt=kwargs.get("cache_salt"),
        lora_name=lora.lora_name if lora else None, lora_path=lora.lora_path if lora else None,
    )
    out[f"{algorithm}/{name}"] = {
        "vllm": [u.maybe_convert_block_hash(h) for h in req.block_hashes],
        "kvconnect": [to_wire(h) for h in mine],
    }
print(json.dumps(out))
"""


@functools.cache
def both_ways(pythonhashseed: str | None) -> dict[str, dict[str, list[int]]]:
    """Every algorithm's hashes of the cases, by vLLM and by kvconnect, in one fresh process
    with this PYTHONHASHSEED (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if pythonhashseed is not None:
        env["PYTHONHASHSEED"] = pythonhashseed
    done = subprocess.run(
        [sys.executable, "-c", BOTH_WAYS, *ALGORITHMS],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, dict[str, list[int]]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def reproducible(algorithm: str, pythonhashseed: str | None) -> bool:
    return pythonhashseed is not None or algorithm in ("sha256", "sha256_cbor")


@pytest.mark.parametrize("pythonhashseed", [None, "0", "4242"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_kvconnect_hashes_equal_vllms(algorithm: str, pythonhashseed: str | None) -> None:
    everything = both_ways(pythonhashseed)
    cases = {k.split("/", 1)[1]: v for k, v in everything.items() if k.startswith(algorithm + "/")}
    assert len(cases) == 4
    for name, got in cases.items():
        assert len(got["vllm"]) == 200 // 32, name
        if reproducible(algorithm, pythonhashseed):
            assert got["kvconnect"] == got["vllm"], (name, algorithm, pythonhashseed)
        else:
            # vLLM seeds xxhash randomly per process without PYTHONHASHSEED: nobody else can
            # compute these hashes (kvconnect's engine draws its own random seed likewise).
            assert got["kvconnect"] != got["vllm"], name
    # The salt enters the hash and an empty salt is no salt, in both.
    assert cases["salted"]["vllm"] != cases["plain"]["vllm"]
    assert cases["empty salt"]["vllm"] == cases["plain"]["vllm"]
    assert cases["lora"]["vllm"] != cases["plain"]["vllm"]


def test_vllms_xxhash_without_pythonhashseed_differs_between_processes() -> None:
    first = both_ways(None)["xxhash/plain"]["vllm"]
    second = both_ways.__wrapped__(None)["xxhash/plain"]["vllm"]  # another process
    assert first != second  # why the router keys such an instance by its own chain
