"""The sampler's time per step, beside a bare softmax + multinomial (the limit).

Prints one line: for a decode step of 16 requests over SmolLM2's vocabulary (49,152), the
batched sampler (`engine/sampler.py`) with every request seeded and penalised (presence,
frequency and repetition over a 512-token prompt and 64 output tokens, a logit_bias, a bad
word, min_p, top_p on half), including building the step's tensors from the kept state; a
bare `softmax` + `multinomial` over the same [16, vocab] tensor, the least any sampler does;
and the same step without the new controls, batched and through the per-row loop the worker
ran before (`legacy_sample`, which had no penalties).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import torch

from kvconnect.engine.sampler import Sampler
from kvconnect.messages import (
    NewRequestData,
    SamplingOptions,
    ScheduledRequest,
    SchedulerOutput,
)

VOCAB = 49152
BATCH = 16
PROMPT, OUTPUT = 512, 64


def legacy_sample(logits: torch.Tensor, s: ScheduledRequest) -> int:
    """The worker's sampler before batching: one row at a time."""
    if s.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / s.temperature, dim=-1)
    if not bool(torch.isfinite(probs).all()):
        return int(logits.argmax())
    if 0 < s.top_k < probs.numel() or s.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = torch.ones_like(sorted_probs, dtype=torch.bool)
        if 0 < s.top_k < probs.numel():
            keep[s.top_k :] = False
        if s.top_p < 1.0:
            keep &= (sorted_probs.cumsum(0) - sorted_probs) < s.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    gen = torch.Generator().manual_seed(s.seed * 1_000_003 + s.num_output_tokens)
    return int(torch.multinomial(probs, 1, generator=gen))


def step_requests(controls: bool) -> tuple[Sampler, list[ScheduledRequest]]:
    """A sampler holding 16 admitted requests, and their decode step."""
    rng = random.Random(0)
    sampler = Sampler(VOCAB)
    out = SchedulerOutput()
    for i in range(BATCH):
        rid = str(i)
        tokens = [rng.randrange(VOCAB) for _ in range(PROMPT + OUTPUT)]
        options = SamplingOptions(
            PROMPT,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            repetition_penalty=1.2,
            min_p=0.01 * (i % 3),
            logit_bias=((rng.randrange(VOCAB), 2.0), (rng.randrange(VOCAB), -5.0)),
            bad_words_token_ids=((tokens[-1], rng.randrange(VOCAB)),),
        )
        out.scheduled_new_reqs.append(NewRequestData(rid, tokens, [], [0]))
        out.scheduled.append(
            ScheduledRequest(
                rid,
                tokens[-1:],
                len(tokens) - 1,
                [0],
                sample=True,
                temperature=0.8,
                top_p=0.9 if i % 2 else 1.0,
                seed=i,
                num_output_tokens=OUTPUT,
                sampling=options if controls else None,
            )
        )
    sampler.update(out)
    return sampler, out.scheduled


def per_step(fn: Callable[[], object], repeat: int = 30) -> float:
    """Seconds of one call, the best of `repeat` (the machine is shared: noise only adds)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    torch.set_num_threads(1)
    logits = torch.randn(BATCH, VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    sampler, reqs = step_requests(controls=True)
    batched = per_step(lambda: sampler.sample(logits, reqs))
    gen = torch.Generator().manual_seed(0)
    bare = per_step(
        lambda: torch.multinomial(torch.softmax(logits / 0.8, dim=-1), 1, generator=gen)
    )
    plain_sampler, plain = step_requests(controls=False)
    plain_batched = per_step(lambda: plain_sampler.sample(logits, plain))
    loop = per_step(lambda: [legacy_sample(logits[i], s) for i, s in enumerate(plain)])
    print(
        f"sampler (batch {BATCH}, vocab {VOCAB}, seeded, 1 thread): batched with penalties, "
        f"bias, bad words, min_p, top_p {batched * 1000:.2f} ms/step vs bare softmax+multinomial "
        f"{bare * 1000:.2f} ms (the limit, {batched / bare:.1f}x); without the new controls "
        f"batched {plain_batched * 1000:.2f} ms vs the old per-row loop {loop * 1000:.2f} ms"
    )


if __name__ == "__main__":
    main()
