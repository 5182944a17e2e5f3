"""The batched sampler against a straightforward per-request reference on fixed logits, with
requests of different controls in one batch, driven by the real scheduler's step messages (so
the worker-side token counts are the ones the engine keeps); seeded draws as before batching."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from kvconnect.engine.block_pool import BlockPool
from kvconnect.engine.request import Request, SamplingParams, bad_words_token_ids
from kvconnect.engine.sampler import (
    Sampler,
    SamplingBatch,
    processed_logits,
    random_probs,
    sample,
)
from kvconnect.engine.scheduler import Scheduler, SchedulerConfig
from kvconnect.messages import ScheduledRequest
from kvconnect.model.tokenizer import ByteTokenizer, load_tokenizer

VOCAB = 300
EOS = 2
BS = 4


def legacy_sample(logits: torch.Tensor, s: ScheduledRequest) -> int:
    """The per-row sampler the engine had before batching (the seeded outputs must not move)."""
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


def reference_logits(row: torch.Tensor, req: Request) -> torch.Tensor:
    """vLLM's controls one at a time, token by token, in vLLM's order."""
    p, out = req.sampling_params, req.output_token_ids
    row = row.clone()
    if len(out) < p.min_tokens:
        for t in [*p.stop_token_ids, EOS]:
            row[t] = -math.inf
    for word in p.bad_words_token_ids:
        prefix = list(word[:-1])
        if len(prefix) <= len(out) and out[len(out) - len(prefix) :] == prefix:
            row[word[-1]] = -math.inf
    for t, b in (p.logit_bias or {}).items():
        row[t] += b
    for t in set(req.prompt_token_ids) | set(out):
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t, c in Counter(out).items():
        row[t] -= p.frequency_penalty * c + p.presence_penalty
    return row


def reference_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """softmax(row / T), then min_p, then top_k and top_p (mass before the token < top_p)."""
    probs = torch.softmax(row.double() / p.temperature, dim=-1)
    if p.min_p > 0:
        probs[probs < p.min_p * probs.max()] = 0
        probs /= probs.sum()
    keep = torch.zeros_like(probs)
    before = 0.0
    for i, t in enumerate(probs.argsort(descending=True).tolist()):
        if (p.top_k > 0 and i >= p.top_k) or before >= p.top_p:
            break
        keep[t], before = probs[t], before + float(probs[t])
    return keep / keep.sum()


MIXED = [
    SamplingParams(max_tokens=12, presence_penalty=1.5, frequency_penalty=0.7),
    SamplingParams(max_tokens=12, temperature=0.9, repetition_penalty=1.8, min_p=0.02, seed=5),
    SamplingParams(
        max_tokens=12, logit_bias={7: 4.0, 9: -50.0}, bad_words_token_ids=((11,), (3, 4, 5))
    ),
    SamplingParams(max_tokens=12, min_tokens=6, stop_token_ids=(8,), temperature=1.2, top_k=40),
    SamplingParams(max_tokens=12, temperature=0.7, top_p=0.8, seed=1),  # no new control
    SamplingParams(
        max_tokens=12, temperature=1.5, repetition_penalty=0.6, frequency_penalty=-1.0, top_p=0.9
    ),
]


def test_a_mixed_batch_equals_the_reference_step_by_step_through_the_real_scheduler() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=24, max_model_len=256)
    scheduler = Scheduler(cfg, BlockPool(128, BS))
    gen = torch.Generator().manual_seed(0)
    requests = {}
    for i, params in enumerate(MIXED):  # prompts repeat tokens, and chunked prefill splits them
        prompt = torch.randint(0, 20, (9 + 3 * i,), generator=gen).tolist()
        requests[str(i)] = Request(str(i), prompt, params, BS, eos_token_id=EOS)
        scheduler.add_request(requests[str(i)])
    sampler = Sampler(VOCAB)
    num_rows = num_changed = 0
    while scheduler.has_unfinished_requests:
        out = scheduler.schedule()
        sampler.update(out)
        reqs = [s for s in out.scheduled if s.sample]
        # Small logits over the first tokens, so that penalties and bans change the choice.
        logits = torch.randn(len(reqs), VOCAB, generator=gen) * 2
        logits[:, :20] += 6
        batch = sampler.batch(reqs)
        got = processed_logits(logits, batch)
        for j, s in enumerate(reqs):
            ref = reference_logits(logits[j], requests[s.request_id])
            torch.testing.assert_close(got[j], ref)
        check_random_rows(got, batch, [requests[s.request_id] for s in reqs])
        result = sample(logits, batch)
        for j, s in enumerate(reqs):
            if s.temperature == 0:
                assert result.token_ids[j] == int(got[j].argmax())
            num_changed += int(got[j].argmax()) != int(logits[j].argmax())
        scheduler.update_from_output(
            out, dict(zip([s.request_id for s in reqs], result.token_ids, strict=True)), None
        )
        num_rows += len(reqs)
    assert num_rows == sum(len(r.output_token_ids) for r in requests.values())
    assert num_changed > num_rows // 4  # the controls did move the choice
    min_tokens = requests["3"].output_token_ids
    assert len(min_tokens) >= 6 and not {EOS, 8} & set(min_tokens[:6])
    assert 11 not in requests["2"].output_token_ids
    out = scheduler.schedule()  # carries the finished ids to the workers
    sampler.update(out)
    assert sampler.num_requests == 0


def check_random_rows(got: torch.Tensor, batch: SamplingBatch, reqs: list[Request]) -> None:
    rows = torch.nonzero(batch.temperature > 0).flatten()
    probs, finite = random_probs(got[rows], batch, rows)
    assert all(finite)
    for j, i in enumerate(rows.tolist()):
        expected = reference_probs(got[i], reqs[i].sampling_params)
        torch.testing.assert_close(probs[j].double() / probs[j].sum(), expected)


def test_batched_draws_equal_the_per_row_sampler_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(1)
    rows = [
        ScheduledRequest(str(i), [0], 0, [0], True, t, p, k, seed=i, num_output_tokens=i % 7)
        for i, (t, p, k) in enumerate(
            [(0.0, 1.0, 0), (0.8, 1.0, 0), (1.3, 1.0, 20), (0.7, 0.9, 0), (1.0, 0.8, 50)] * 8
        )
    ]
    sampler = Sampler(VOCAB)
    for _ in range(20):
        logits = torch.randn(len(rows), VOCAB, generator=gen) * 3
        got = sampler.sample(logits, rows).token_ids
        assert got == [legacy_sample(logits[i], s) for i, s in enumerate(rows)]


def test_top_k_one_and_a_tiny_top_p_are_greedy_and_seeds_repeat() -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
    best = int(logits.argmax())
    sampler = Sampler(VOCAB)

    def one(**kw: float) -> int:
        s = ScheduledRequest("r", [1], 0, [0], sample=True, **kw)  # type: ignore[arg-type]
        return sampler.sample(logits, [s]).token_ids[0]

    assert {one(temperature=1.0, top_k=1, seed=i) for i in range(20)} == {best}
    assert {one(temperature=1.0, top_p=1e-6, seed=i) for i in range(20)} == {best}
    top5 = set(logits[0].topk(5).indices.tolist())
    picks = {one(temperature=5.0, top_k=5, seed=i) for i in range(200)}
    assert picks <= top5 and len(picks) > 1
    assert one(temperature=1.0, seed=11) == one(temperature=1.0, seed=11)


def test_min_p_keeps_exactly_the_tokens_within_its_share_of_the_top() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    for min_p, kept in [(0.0, 5), (0.1, 4), (0.19, 3), (0.21, 2), (0.7, 1), (1.0, 1)]:
        batch = SamplingBatch(
            torch.tensor([1.0]),
            torch.tensor([0]),
            torch.tensor([1.0]),
            torch.tensor([min_p]),
            seeds=[0],
        )
        probs, _ = random_probs(logits, batch, torch.tensor([0]))
        assert int((probs > 0).sum()) == kept, min_p


def test_logprobs_are_the_raw_log_softmax_with_vllm_ranks() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 0.0], [0.0, 0.0, 5.0, 1.0, 2.0]])
    batch = SamplingBatch(
        torch.tensor([0.0, 0.0]),
        torch.tensor([0, 0]),
        torch.tensor([1.0, 1.0]),
        torch.tensor([0.0, 0.0]),
        seeds=[0, 0],
        banned=(torch.tensor([1]), torch.tensor([2])),  # row 1 cannot take its top token
        num_logprobs=[2, 0],
    )
    out = sample(logits, batch)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.token_ids == [1, 4]
    first, second = out.logprobs
    assert first is not None and second is not None
    assert first.token_id == 1 and first.logprob == pytest.approx(float(raw[0, 1]))
    assert first.rank == 2  # tied with token 3: vLLM counts the tokens >= it
    assert first.top_token_ids[0] in (1, 3) and len(first.top_token_ids) == 2
    assert first.top_logprobs == pytest.approx((float(raw[0, 1]), float(raw[0, 3])))
    # logprobs are from before the ban: the chosen token is second of the raw distribution
    assert second.rank == 2 and second.logprob == pytest.approx(float(raw[1, 4]))
    assert second.top_token_ids == () and second.top_logprobs == ()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.1),
        ("frequency_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("inf")),
        ("repetition_penalty", 1e300),  # no float32: the sampler could not hold it
        ("min_p", 1.5),
        ("min_p", True),
        ("min_tokens", -1),
        ("min_tokens", 17),  # over max_tokens=16
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {3: float("inf")}),
        ("logit_bias", {"3": 1.0}),
        ("logit_bias", [(3, 1.0)]),
        ("bad_words_token_ids", ((),)),
        ("bad_words_token_ids", "ab"),
        ("bad_words_token_ids", ((1, -2),)),
        ("logprobs", 21),
        ("logprobs", -1),
        ("prompt_logprobs", 1.0),
    ],
)
def test_bad_values_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_token_ids_outside_the_vocabulary_are_refused_naming_the_field() -> None:
    for field, value in [
        ("logit_bias", {300: 1.0}),
        ("bad_words_token_ids", ((1, 300),)),
        ("stop_token_ids", (300,)),
    ]:
        params = SamplingParams(**{field: value})  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=f"SamplingParams.{field}=.*token id 300"):
            params.check_token_ids(VOCAB)
    SamplingParams(logit_bias={299: 1.0}).check_token_ids(VOCAB)


def test_requests_without_new_controls_send_no_options() -> None:
    plain = Request("a", [1, 2], SamplingParams(temperature=0.5, top_k=3), BS, eos_token_id=EOS)
    assert plain.sampling_options() is None
    asks = Request("b", [1, 2], SamplingParams(min_tokens=2, logprobs=0), BS, eos_token_id=EOS)
    options = asks.sampling_options()
    assert options is not None and options.min_tokens_banned_ids == (EOS,)
    assert options.logprobs == 0 and options.num_prompt_tokens == 2


def test_bad_words_become_token_sequences_bare_and_after_a_space_as_in_vllm() -> None:
    tok = load_tokenizer("smollm2")
    words = bad_words_token_ids(["Paris", " capital city", "Paris"], tok)
    assert [tok.decode(list(w)) for w in words] == [
        "Paris",
        " Paris",
        "capital city",
        " capital city",
    ]
    assert bad_words_token_ids(["ab"], ByteTokenizer()) == ((97, 98),)  # " ab" is 3 tokens
    for bad in ([""], [3]):
        with pytest.raises(ValueError, match="bad_words"):
            bad_words_token_ids(bad, ByteTokenizer())  # type: ignore[list-item]
