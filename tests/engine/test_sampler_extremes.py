"""No sampling input can break a step (issue 35): batches that mix requests with extreme values
of every control (subnormals, 0, -0.0, huge values, infinities, NaN) go through the real
scheduler's step messages into the batched sampler. Each request is refused by
`SamplingParams` (the 400 at validation) or gets a token in the vocabulary at every step; no
batch raises. tests/serve/test_sampling_api.py sends the same values through `kvconnect serve`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvconnect.engine.block_pool import BlockPool
from kvconnect.engine.request import Request, SamplingParams
from kvconnect.engine.sampler import Sampler
from kvconnect.engine.scheduler import Scheduler, SchedulerConfig

VOCAB = 64
EOS = 2
BS = 4

EXTREME_FLOATS = [
    0.0, -0.0, 5e-324, 1e-320, 1e-310, 1.4e-45, 1e-40, 1.1754944e-38, 1e-7, 1e-5, 0.5,
    1 - 1e-16, 1.0, 1.0000001, 2.0, 100.0, 1e6, 3.4028234e38, 3.5e38, 1e300, 1.7e308,
    math.inf, -math.inf, math.nan, -5e-324, -1e-320, -1.0, -2.0, -100.0, -1e300,
]  # fmt: skip
EXTREME_INTS = [0, -1, 1, 2, VOCAB - 1, VOCAB, VOCAB + 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63)]

floats = st.sampled_from(EXTREME_FLOATS) | st.floats(allow_nan=True, allow_infinity=True)
ints = st.sampled_from(EXTREME_INTS) | st.integers()
token_ids = st.integers(0, VOCAB - 1)

controls = st.fixed_dictionaries(
    {},
    optional={
        "temperature": floats,
        "top_p": floats,
        "top_k": ints,
        "min_p": floats,
        "presence_penalty": floats,
        "frequency_penalty": floats,
        "repetition_penalty": floats,
        "seed": ints,
        "min_tokens": st.integers(0, 3) | ints,
        "logit_bias": st.dictionaries(token_ids, floats, max_size=VOCAB),
        "bad_words_token_ids": st.lists(st.lists(token_ids, min_size=1, max_size=2), max_size=3),
        "stop_token_ids": st.lists(token_ids, max_size=3),
        "logprobs": st.sampled_from([None, 0, 5]),
        "ignore_eos": st.booleans(),
    },
)
BIAS_ALL = dict.fromkeys(range(VOCAB), -100.0)
logit_scales = st.sampled_from([1.0, 1e-30, 30.0, 1e4, 1e38])


def admitted(fields: dict[str, Any]) -> SamplingParams | None:
    """The request's params, or None where validation refuses them (serve's 400)."""
    try:
        return SamplingParams(max_tokens=3, **fields)
    except ValueError:
        return None


# The crash of issue 35 exactly: top_p 1e-320 is 0 in float32, and the cut kept no token.
@example(requests=[{"temperature": 1.0, "top_p": 1e-320}], scale=1.0, seed=0)
@example(requests=[{"temperature": 1.0, "top_k": 2**63}], scale=1.0, seed=0)  # a long overflows
@example(requests=[{"temperature": 1.0, "top_p": 1.4e-45, "min_p": 1.0}], scale=1e38, seed=1)
@example(requests=[{"temperature": 100.0, "logit_bias": BIAS_ALL}], scale=1.0, seed=2)
@example(
    requests=[{"temperature": 1e-5, "top_k": 1, "repetition_penalty": 3.4e38}], scale=1e4, seed=3
)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(controls, min_size=1, max_size=6),
    scale=logit_scales,
    seed=st.integers(0, 2**32 - 1),
)
def test_every_request_gets_a_token_or_a_refusal_and_no_batch_raises(
    requests: list[dict[str, Any]], scale: float, seed: int
) -> None:
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=32, max_model_len=64), BlockPool(64, BS)
    )
    sampler = Sampler(VOCAB)
    gen = torch.Generator().manual_seed(seed)
    running = []
    for i, fields in enumerate(requests):
        if (params := admitted(fields)) is not None:
            prompt = torch.randint(0, VOCAB, (5 + i,), generator=gen).tolist()
            running.append(Request(str(i), prompt, params, BS, eos_token_id=EOS))
            scheduler.add_request(running[-1])
    while scheduler.has_unfinished_requests:
        out = scheduler.schedule()
        sampler.update(out)
        reqs = [s for s in out.scheduled if s.sample]
        logits = torch.randn(len(reqs), VOCAB, generator=gen) * scale
        result = sampler.sample(logits, reqs)
        assert all(0 <= t < VOCAB for t in result.token_ids), result.token_ids
        scheduler.update_from_output(
            out, dict(zip([s.request_id for s in reqs], result.token_ids, strict=True)), None
        )
    for r in running:  # each admitted request got its tokens (max_tokens, or a stop)
        assert 1 <= len(r.output_token_ids) <= 3
    sampler.update(scheduler.schedule())  # carries the finished ids to the sampler
    assert sampler.num_requests == 0
