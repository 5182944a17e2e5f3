"""SmolLM2-135M's logprobs through the engine against transformers' log_softmax on the same
GGUF file (the reference model of tests/model/test_smollm2.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvconnect import LLM, SamplingParams
from tests.model.test_smollm2 import QUESTION, reference

pytestmark = pytest.mark.slow
__all__ = ["reference"]  # the module fixture, shared
TOL = 2e-4
"""fp32 tolerance on a logprob (the logits themselves agree within 5e-4, test_smollm2.py)."""


def test_logprobs_equal_transformers_log_softmax_on_the_same_gguf(
    reference: tuple[Any, Any],
) -> None:
    _, ref_model = reference
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    with LLM("smollm2", max_num_batched_tokens=16, num_kv_blocks=64) as llm:  # chunked prefill
        prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(QUESTION))
        (out,) = llm.generate([prompt], params)
    ids = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(ref_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    positions = [(i - 1, lp) for i, lp in enumerate(out.prompt_logprobs) if i]
    assert out.outputs[0].logprobs is not None
    positions += [(len(prompt) - 1 + j, lp) for j, lp in enumerate(out.outputs[0].logprobs)]
    assert len(positions) == len(ids) - 1
    for pos, lp in positions:
        assert lp is not None and lp.token_id == ids[pos + 1]
        row = ref[pos]
        mine = float(row[lp.token_id])
        assert lp.logprob == pytest.approx(mine, abs=TOL)
        # The rank, and the alternatives' order, as far as fp32 noise can tell tokens apart.
        assert int((row > mine + TOL).sum()) + 1 <= lp.rank <= int((row >= mine - TOL).sum())
        assert list(lp.top_logprobs) == pytest.approx(row.topk(5).values.tolist(), abs=TOL)
        assert list(lp.top_logprobs) == pytest.approx(row[list(lp.top_token_ids)].tolist(), abs=TOL)
