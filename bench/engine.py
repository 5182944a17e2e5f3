"""Engine throughput and time to first token, beside a bare in-process forward (the limit).

Prints one line: prefill and decode tokens/s of the tiny model through `LLM` at TP=1 and TP=2
(worker processes, scheduler, IPC), the prefill rate of the same 8 x 512-token batch through the
same model called directly in this process with no engine (the limit), and the TTFT of a
2,048-token prompt cold vs a full prefix-cache hit.
"""

from __future__ import annotations

import random
import time

import torch

from kvconnect import LLM, SamplingParams
from kvconnect.model.llama import AttentionMetadata
from kvconnect.model.loader import load_model

BLOCK = 16


def bare_prefill_rate(num_prompts: int, prompt_len: int) -> float:
    """Tokens/s of one forward over the same prefill batch the engine gets, called directly
    in this process: no scheduler, no worker processes, no IPC, all cores."""
    model, _ = load_model("tiny")
    per = prompt_len // BLOCK
    caches = [
        torch.zeros(model.kv_cache_shape(num_prompts * per, BLOCK)) for _ in model.layer_names
    ]
    tables = [list(range(i * per, (i + 1) * per)) for i in range(num_prompts)]
    num_tokens = num_prompts * prompt_len
    meta = AttentionMetadata(
        [prompt_len] * num_prompts,
        [prompt_len] * num_prompts,
        tables,
        torch.arange(num_tokens),
        BLOCK,
    )
    ids = torch.randint(0, 256, (num_tokens,))
    pos = torch.arange(prompt_len).repeat(num_prompts)
    best = 0.0
    with torch.inference_mode():
        for _ in range(3):
            t0 = time.perf_counter()
            hidden = model(ids, pos, caches, meta)
            model.compute_logits(hidden[prompt_len - 1 :: prompt_len])
            best = max(best, num_tokens / (time.perf_counter() - t0))
    return best


def measure(tp: int) -> tuple[float, float, float, float]:
    rng = random.Random(tp)
    with LLM(
        "tiny", tensor_parallel_size=tp, num_kv_blocks=1024, max_num_batched_tokens=2048
    ) as llm:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm up
        prompts = [[rng.randrange(256) for _ in range(512)] for _ in range(8)]
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
        prefill = 8 * 512 / (time.perf_counter() - t0)
        short = [[rng.randrange(256) for _ in range(16)] for _ in range(16)]
        t0 = time.perf_counter()
        llm.generate(short, SamplingParams(max_tokens=64, ignore_eos=True))
        decode = 16 * 64 / (time.perf_counter() - t0)
        long_prompt = [rng.randrange(256) for _ in range(2048)]
        t0 = time.perf_counter()
        llm.generate([long_prompt], SamplingParams(max_tokens=1))
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = llm.generate([long_prompt], SamplingParams(max_tokens=1))
        hit = time.perf_counter() - t0
        assert out[0].num_cached_tokens == 2032, out[0].num_cached_tokens
    return prefill, decode, cold, hit


def main() -> None:
    tp1, tp2 = measure(1), measure(2)
    bare = bare_prefill_rate(8, 512)
    print(
        f"engine (tiny, CPU): prefill tok/s TP1 {tp1[0]:.0f} TP2 {tp2[0]:.0f} "
        f"(bare in-process forward {bare:.0f}); decode tok/s TP1 {tp1[1]:.0f} TP2 {tp2[1]:.0f}; "
        f"TTFT 2048-token prompt cold {tp1[2] * 1000:.0f} ms vs prefix hit "
        f"{tp1[3] * 1000:.0f} ms at TP1 ({tp2[2] * 1000:.0f} vs {tp2[3] * 1000:.0f} ms at TP2)"
    )


if __name__ == "__main__":
    main()
