"""Sampling controls and logprobs through the whole engine (real worker processes): logprobs
against transformers on the same weights, prompt logprobs across prefill chunks and past the
prefix cache, min_tokens, and bad input refused before it reaches a worker."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from kvconnect import LLM, SamplingParams
from kvconnect.engine.structured_output import StructuredOutputsParams
from kvconnect.messages import PositionLogprobs
from kvconnect.model.tokenizer import BYTE_EOS
from tests.engine.test_llm import PROMPTS, assert_nothing_held, dense_model

pytestmark = pytest.mark.slow

PROMPT = PROMPTS[0]  # 190 tokens: six prefill chunks of 32


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM("tiny", max_num_batched_tokens=32, num_kv_blocks=128) as engine:
        yield engine


def assert_matches(lp: PositionLogprobs, ref: torch.Tensor, token_id: int, k: int) -> None:
    """`lp` is `ref`'s (a log_softmax row) view of `token_id`, with k alternatives."""
    assert lp.token_id == token_id
    assert lp.logprob == pytest.approx(float(ref[token_id]), abs=1e-4)
    assert lp.rank == int((ref >= ref[token_id]).sum())
    top = ref.topk(k)
    assert list(lp.top_logprobs) == pytest.approx(top.values.tolist(), abs=1e-4)
    assert set(lp.top_token_ids) == set(top.indices.tolist())  # ties may order either way


def test_logprobs_equal_transformers_across_prefill_chunks_and_past_the_prefix_cache(
    llm: LLM,
) -> None:
    greedy = SamplingParams(max_tokens=5, ignore_eos=True)
    llm.generate([PROMPT], greedy)  # the prompt's blocks are in the prefix cache now
    params = replace(greedy, logprobs=4, prompt_logprobs=2)
    (out,) = llm.generate([PROMPT], params)
    assert out.num_cached_tokens == 0  # prompt logprobs need every position's logits
    ids = PROMPT + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(dense_model()(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(PROMPT)
    assert out.prompt_logprobs[0] is None
    for i, lp in enumerate(out.prompt_logprobs[1:], start=1):
        assert lp is not None
        assert_matches(lp, ref[i - 1], PROMPT[i], 2)
    sampled = out.outputs[0].logprobs
    assert sampled is not None and len(sampled) == 5
    for j, lp in enumerate(sampled):
        assert_matches(lp, ref[len(PROMPT) - 1 + j], ids[len(PROMPT) + j], 4)
        assert lp.rank == 1  # greedy
    (again,) = llm.generate([PROMPT], greedy)
    assert again.num_cached_tokens > 0 and again.prompt_logprobs is None
    assert again.outputs[0].logprobs is None
    assert_nothing_held(llm)


def test_streamed_logprobs_come_with_their_tokens_and_prompt_logprobs_once(llm: LLM) -> None:
    params = SamplingParams(max_tokens=3, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    request = llm.add_request(PROMPTS[1], params)
    deltas = []
    while llm.has_unfinished_requests:
        deltas += [d for d in llm.step() if d.request_id == request.request_id]
    assert [len(d.token_ids) for d in deltas] == [1, 1, 1]
    for d in deltas:
        assert d.logprobs is not None and [lp.token_id for lp in d.logprobs] == d.token_ids
        assert all(lp.top_token_ids == () for lp in d.logprobs)
    first, *rest = deltas
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(PROMPTS[1])
    assert all(d.prompt_logprobs is None for d in rest)
    assert_nothing_held(llm)


def test_min_tokens_holds_eos_back_until_reached(llm: LLM) -> None:
    eager = SamplingParams(max_tokens=10, logit_bias={BYTE_EOS: 100.0})
    (now,) = llm.generate([PROMPTS[2]], eager)
    assert now.outputs[0].token_ids == [BYTE_EOS]
    (held,) = llm.generate([PROMPTS[2]], replace(eager, min_tokens=4, stop=("x",)))
    tokens = held.outputs[0].token_ids
    assert len(tokens) == 5 and tokens[-1] == BYTE_EOS and BYTE_EOS not in tokens[:4]
    assert held.outputs[0].finish_reason == "stop"
    stop_id = SamplingParams(max_tokens=6, min_tokens=3, stop_token_ids=(40,))
    (out,) = llm.generate([PROMPTS[2]], replace(stop_id, logit_bias={40: 100.0}))
    tokens = out.outputs[0].token_ids
    assert len(tokens) == 4 and tokens[-1] == 40 and 40 not in tokens[:3]
    assert out.outputs[0].stop_reason == 40
    assert_nothing_held(llm)


def test_out_of_vocabulary_ids_are_refused_at_add_request_and_the_engine_goes_on(
    llm: LLM,
) -> None:
    vocab = llm.info.vocab_size
    for field, value in [
        ("logit_bias", {vocab: 1.0}),
        ("bad_words_token_ids", ((1, vocab),)),
        ("stop_token_ids", (vocab + 5,)),
    ]:
        with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
            llm.add_request(PROMPTS[2], SamplingParams(**{field: value}))  # type: ignore[arg-type]
    assert not llm.has_unfinished_requests
    (out,) = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 2
    assert_nothing_held(llm)


def test_a_preempted_request_samples_as_if_it_never_was(llm: LLM) -> None:
    """Its worker-side state (token counts, bad-word tail) is rebuilt on readmission; its
    grammar's matcher, kept with the scheduler, goes on where it was."""
    params = SamplingParams(
        max_tokens=40,
        ignore_eos=True,
        temperature=0.9,
        seed=7,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        repetition_penalty=1.3,
        bad_words_token_ids=((100,), (101, 102)),
        logprobs=1,
        structured_outputs=StructuredOutputsParams(regex="[a-z ]{30,60}"),
    )
    prompts = [PROMPTS[1][:30], PROMPTS[2] * 6, PROMPTS[1][10:40], PROMPTS[0][:35]]
    roomy = [o.outputs[0] for o in llm.generate(prompts, params)]
    with LLM("tiny", max_num_batched_tokens=32, num_kv_blocks=12) as tight:  # 4 x 5 needed
        cramped = [o.outputs[0] for o in tight.generate(prompts, params)]
        assert tight.stats().num_preemptions > 0
        assert_nothing_held(tight)
    assert [o.token_ids for o in cramped] == [o.token_ids for o in roomy]
    assert all(re.fullmatch("[a-z ]{30,40}", o.text) and "d" not in o.text for o in roomy)
    for a, b in zip(cramped, roomy, strict=True):
        assert a.logprobs is not None and b.logprobs is not None
        assert [lp.logprob for lp in a.logprobs] == pytest.approx(
            [lp.logprob for lp in b.logprobs], abs=1e-4
        )
