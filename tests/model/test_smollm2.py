"""SmolLM2-135M-Instruct from the packaged GGUF, against transformers loading the same file."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from kvconnect import LLM, SamplingParams
from kvconnect.model.loader import load_model
from kvconnect.model.source import resolve_model
from kvconnect.model.tokenizer import load_tokenizer
from tests.model.test_llama import run_paged

pytestmark = [pytest.mark.slow, pytest.mark.realmodel]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = [504, 3575, 282, 4649, 314, 7042, 30, 2]  # "The capital of France is Paris." <|im_end|>
MIXED = [
    "Hello world",
    "  leading spaces and\ttabs\nnew lines\r\n",
    "Ünïcödé, 中文字符, emoji 🙂👍, accents café",
    "numbers 1234567890 3.14159 -42 1e-5",
    "code: def f(x):\n    return {'a': [1, 2]}  # comment",
    "<|im_start|>user\nspecial tokens stay whole<|im_end|>",
    "",
]
TOL = 2e-4
"""fp32 tolerance on a logprob (the logits themselves agree within 5e-4)."""


@pytest.fixture(scope="module")
def reference() -> tuple[Any, Any]:
    """transformers' tokenizer and model from the same GGUF file (it dequantizes too).

    transformers parses the file three times (config, tokenizer, weights) and builds gguf's
    tensor-name map once per module of the model: 42 s here. The loads below share one parsed
    file and one map per (architecture, layer count), 18 s; what they return is the same.
    """
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model("smollm2").path
    assert path is not None
    readers: dict[tuple[str, str], Any] = {}
    parse = gguf.GGUFReader

    def shared_reader(file: Any, mode: str = "r") -> Any:
        key = (str(file), mode)
        if key not in readers:
            readers[key] = parse(file, mode)
        return readers[key]

    name_map = functools.lru_cache(gguf.get_tensor_name_map)
    with (
        mock.patch.object(gguf, "GGUFReader", shared_reader),
        mock.patch.object(gguf, "get_tensor_name_map", name_map),
    ):
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()
    return tok, model


def test_tokenizer_equals_transformers_from_the_same_gguf(reference: tuple[Any, Any]) -> None:
    ref_tok, _ = reference
    ours = load_tokenizer("smollm2")
    for text in MIXED:
        ids = ours.encode(text)
        assert ids == ref_tok(text, add_special_tokens=False).input_ids, text
        assert ours.decode(ids) == ref_tok.decode(ids, skip_special_tokens=True), text
    assert ours.eos_token_id == 2
    rendered = ours.apply_chat_template(QUESTION)
    assert rendered == ref_tok.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=False
    )
    assert ours.encode(rendered) == ref_tok.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_logits_equal_transformers_on_prefill_and_decode(reference: tuple[Any, Any]) -> None:
    _, ref_model = reference
    ours, tok = load_model("smollm2")
    ids = tok.encode(tok.apply_chat_template(QUESTION))
    with torch.no_grad():
        for _ in range(3):  # three greedy decode steps after the prefill
            ids.append(int(ref_model(torch.tensor([ids])).logits[0, -1].argmax()))
        expected = ref_model(torch.tensor([ids])).logits[0]
    for chunk in (len(ids), 16):  # whole prefill, then chunked through the paged cache
        got = run_paged(ours, ids, chunk)
        torch.testing.assert_close(got, expected, atol=5e-4, rtol=1e-4)  # seen: 7e-5
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


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


@pytest.mark.parametrize(
    ("tp", "prefix_caching", "chunked"),
    [(1, True, True), (1, False, False), (3, True, True), (3, False, False)],
)
def test_the_greedy_chat_answer_token_for_token(
    tp: int, prefix_caching: bool, chunked: bool
) -> None:
    with LLM(
        "smollm2",
        tensor_parallel_size=tp,
        enable_prefix_caching=prefix_caching,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=16 if chunked else 1024,
        num_kv_blocks=128,
    ) as llm:
        params = SamplingParams(max_tokens=20)
        first = llm.chat(QUESTION, params)[0]
        assert first.outputs[0].token_ids == ANSWER and first.outputs[0].finish_reason == "stop"
        assert first.outputs[0].text == "The capital of France is Paris."
        again = llm.chat(QUESTION, params)[0]  # from the prefix cache when it is on
        assert again.outputs[0].token_ids == ANSWER
        assert again.num_cached_tokens == (32 if prefix_caching else 0)  # 37 tokens, blocks of 16
        llm.scheduler.check_integrity()
        assert llm.scheduler.pool.num_free_blocks == llm.scheduler.pool.num_blocks


def test_each_ranks_shard_is_its_slice_of_the_whole_tensor() -> None:
    """A rank dequantizes only its own rows (gguf.py): the result equals the whole tensor,
    dequantized and un-interleaved, then sliced, for every sharded parameter of a layer."""
    from kvconnect.model.gguf_weights import GGUFWeights
    from kvconnect.model.loader import load_model_info, shard_dim

    path = resolve_model("smollm2").path
    assert path is not None
    weights = GGUFWeights(path, load_model_info("smollm2")[0])
    names = [
        f"model.layers.0.{p}.weight"
        for p in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.down_proj",
        )
    ]
    for name in names:
        dim = shard_dim(name)
        assert dim is not None, name
        whole = weights.read(name, None, 0, 1)
        shards = [weights.read(name, dim, r, 3) for r in range(3)]
        assert torch.equal(torch.cat(shards, dim), whole), name


def test_two_tensor_parallel_ranks_cannot_split_nine_heads() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide"):
        LLM("smollm2", tensor_parallel_size=2)


def test_offload_round_trip_on_the_real_model_gives_the_same_tokens(tmp_path: Path) -> None:
    transfer = {
        "kv_connector": "OffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"chunk_size": 16, "tiers": [{"kind": "cpu"}]},
    }
    with LLM("smollm2", kv_transfer_config=transfer, num_kv_blocks=128) as llm:
        first = llm.chat(QUESTION, SamplingParams(max_tokens=20))[0]
        connector = llm.connector
        assert connector is not None
        deadline_steps = 0
        while connector.scheduler.quorum.num_released < 2:  # type: ignore[attr-defined]
            llm.step()  # the two whole chunks reach the cpu tier
            deadline_steps += 1
            assert deadline_steps < 10_000
        assert llm.reset_prefix_cache() is True
        again = llm.chat(QUESTION, SamplingParams(max_tokens=20))[0]
        assert again.num_external_tokens == 32 and again.num_cached_tokens == 0
        assert again.outputs[0].token_ids == first.outputs[0].token_ids == ANSWER
        llm.scheduler.check_integrity()
