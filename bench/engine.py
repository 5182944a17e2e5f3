"""Engine throughput and time to first token, beside a bare forward (the limit).

Prints one line: prefill and decode tokens/s of the tiny model through `LLM` at TP=1 and TP=2
(worker processes, scheduler, IPC), the prefill rate of the same 8 x 512-token batch through the
same model called directly in this process with no engine (the limit), and the TTFT of a
2,048-token prompt cold vs a full prefix-cache hit. Then the same for SmolLM2-135M (the
packaged GGUF) at TP=1, with a third TTFT: the prompt's KV loaded from the offload connector's
cpu tier, and beside it transformers' own forward of the same 2,048 tokens (the limit).
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


def measure(tp: int, model: str = "tiny") -> tuple[float, float, float, float]:
    rng = random.Random(tp)
    vocab = 256 if model == "tiny" else 49152
    with LLM(
        model, tensor_parallel_size=tp, num_kv_blocks=1024, max_num_batched_tokens=2048
    ) as llm:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm up
        prompts = [[rng.randrange(vocab) for _ in range(512)] for _ in range(8)]
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
        prefill = 8 * 512 / (time.perf_counter() - t0)
        short = [[rng.randrange(vocab) for _ in range(16)] for _ in range(16)]
        t0 = time.perf_counter()
        llm.generate(short, SamplingParams(max_tokens=64, ignore_eos=True))
        decode = 16 * 64 / (time.perf_counter() - t0)
        long_prompt = [rng.randrange(vocab) for _ in range(2048)]
        t0 = time.perf_counter()
        llm.generate([long_prompt], SamplingParams(max_tokens=1))
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = llm.generate([long_prompt], SamplingParams(max_tokens=1))
        hit = time.perf_counter() - t0
        assert out[0].num_cached_tokens == 2032, out[0].num_cached_tokens
    return prefill, decode, cold, hit


def smollm2_cpu_tier_ttft(prompt: list[int]) -> float:
    """TTFT of `prompt` whose KV comes back from the offload connector's cpu tier."""
    transfer = {
        "kv_connector": "OffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"chunk_size": 256, "tiers": [{"kind": "cpu"}]},
    }
    with LLM("smollm2", kv_transfer_config=transfer, num_kv_blocks=1024) as llm:
        llm.generate([prompt], SamplingParams(max_tokens=1))
        sched = llm.connector.scheduler  # type: ignore[union-attr]
        while sched.quorum.num_released < len(prompt) // 256 - 1:
            llm.step()  # the chunks reach the tier
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        out = llm.generate([prompt], SamplingParams(max_tokens=1))
        took = time.perf_counter() - t0
        assert out[0].num_external_tokens == 1792, out[0].num_external_tokens
    return took


def transformers_forward_seconds(prompt: list[int]) -> float:
    """transformers' own forward over the same tokens, from the same GGUF (the limit)."""
    from transformers import AutoModelForCausalLM

    from kvconnect.model.source import resolve_model

    path = resolve_model("smollm2").path
    assert path is not None
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    best = float("inf")
    with torch.inference_mode():
        for _ in range(3):
            t0 = time.perf_counter()
            model(torch.tensor([prompt]), use_cache=False)
            best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    tp1, tp2 = measure(1), measure(2)
    bare = bare_prefill_rate(8, 512)
    print(
        f"engine (tiny, CPU): prefill tok/s TP1 {tp1[0]:.0f} TP2 {tp2[0]:.0f} "
        f"(bare in-process forward {bare:.0f}); decode tok/s TP1 {tp1[1]:.0f} TP2 {tp2[1]:.0f}; "
        f"TTFT 2048-token prompt cold {tp1[2] * 1000:.0f} ms vs prefix hit "
        f"{tp1[3] * 1000:.0f} ms at TP1 ({tp2[2] * 1000:.0f} vs {tp2[3] * 1000:.0f} ms at TP2)"
    )
    smol = measure(1, "smollm2")
    prompt = [random.Random(9).randrange(49152) for _ in range(2048)]
    cpu_tier = smollm2_cpu_tier_ttft(prompt)
    reference = transformers_forward_seconds(prompt)
    print(
        f"engine (smollm2, CPU, TP1): prefill tok/s {smol[0]:.0f} (transformers forward "
        f"{2048 / reference:.0f}); decode tok/s {smol[1]:.0f}; TTFT 2048-token prompt cold "
        f"{smol[2] * 1000:.0f} ms vs prefix hit {smol[3] * 1000:.0f} ms vs cpu-tier load "
        f"{cpu_tier * 1000:.0f} ms (transformers' own forward of it {reference * 1000:.0f} ms)"
    )


if __name__ == "__main__":
    main()
