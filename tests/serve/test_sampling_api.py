"""The sampling controls through the OpenAI Python client, on completions and chat, against
`kvconnect serve` and the router in front: presence/frequency/repetition penalties,
logit_bias, and vLLM's min_p, min_tokens and bad_words change the output as they should, and
a bad value is a 400 naming the request's field."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from kvconnect.tokenizer import BYTE_EOS
from tests.serving import RouterProcess, Serve

pytestmark = pytest.mark.slow

PROMPT = "Hello"
MESSAGES: Any = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def served(tiny_api: tuple[Serve, RouterProcess]) -> tuple[Serve, RouterProcess]:
    return tiny_api  # tests/serve/conftest.py (module scope keeps the module on one worker)


@pytest.fixture(params=["serve", "router"])
def client(request: pytest.FixtureRequest, served: tuple[Serve, RouterProcess]) -> openai.OpenAI:
    target = served[0] if request.param == "serve" else served[1]
    return openai.OpenAI(base_url=target.url + "/v1", api_key="unused", max_retries=0)


def tokens(
    client: openai.OpenAI, max_tokens: int = 24, stream: bool = False, **fields: Any
) -> list[int]:
    """The generated token ids of one greedy completion (unless `fields` say otherwise)."""
    extra = {"ignore_eos": True, "return_token_ids": True, **fields.pop("extra_body", {})}
    args: dict[str, Any] = {"temperature": 0, **fields}
    if stream:
        chunks = client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=max_tokens,
            stream=True,
            extra_body=extra,
            **args,
        )
        return [t for c in chunks for t in c.choices[0].token_ids]  # type: ignore[attr-defined]
    whole = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=max_tokens, extra_body=extra, **args
    )
    return list(whole.choices[0].token_ids)  # type: ignore[attr-defined]


def chat_text(client: openai.OpenAI, max_tokens: int = 12, **fields: Any) -> str:
    extra = {"ignore_eos": True, **fields.pop("extra_body", {})}
    reply = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=max_tokens,
        temperature=0,
        extra_body=extra,
        **fields,
    )
    return reply.choices[0].message.content or ""


@pytest.mark.parametrize("penalty", ["frequency_penalty", "presence_penalty"])
def test_a_large_penalty_keeps_greedy_from_repeating_a_token(
    client: openai.OpenAI, penalty: str
) -> None:
    plain = tokens(client)
    assert len(set(plain)) < len(plain)  # greedy repeats itself on this model
    for stream in (False, True):
        penalised = tokens(client, stream=stream, **{penalty: 2.0})
        assert len(set(penalised)) == len(penalised) == 24
        assert penalised[0] == plain[0]  # nothing to penalise before the first token
    # Chat takes it too.
    assert chat_text(client, **{penalty: 2.0}) != chat_text(client)


def test_repetition_penalty_is_vllms_extension_on_both_endpoints(client: openai.OpenAI) -> None:
    plain = tokens(client)
    assert tokens(client, extra_body={"repetition_penalty": 1.0}) == plain  # 1 is off
    assert tokens(client, extra_body={"repetition_penalty": 2.0}) != plain
    assert chat_text(client, extra_body={"repetition_penalty": 2.0}) != chat_text(client)


def test_logit_bias_bans_and_forces_tokens(client: openai.OpenAI) -> None:
    plain = tokens(client, max_tokens=4)
    banned = tokens(client, max_tokens=4, logit_bias={str(plain[0]): -100})
    assert plain[0] not in banned
    forced = tokens(client, max_tokens=4, logit_bias={"65": 100}, stream=True)
    assert forced == [65] * 4
    clamped = tokens(client, max_tokens=4, logit_bias={"65": 1e6})  # clamped to 100, as vLLM
    assert clamped == [65] * 4
    assert chat_text(client, max_tokens=3, logit_bias={"66": 100}) == "BBB"


def test_min_tokens_holds_eos_back(client: openai.OpenAI) -> None:
    eos = {"logit_bias": {str(BYTE_EOS): 100}}
    assert tokens(client, extra_body={"ignore_eos": False}, **eos) == [BYTE_EOS]
    held = tokens(client, extra_body={"ignore_eos": False, "min_tokens": 5}, **eos)
    assert len(held) == 6 and held[-1] == BYTE_EOS and BYTE_EOS not in held[:5]
    reply = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        extra_body={"min_tokens": 3},
        **eos,  # type: ignore[arg-type]
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 4
    assert reply.choices[0].finish_reason == "stop"


def test_min_p_one_leaves_only_the_most_likely_token(client: openai.OpenAI) -> None:
    greedy = tokens(client, max_tokens=8)
    sampled = tokens(client, max_tokens=8, temperature=1.0, seed=3)
    assert sampled != greedy  # the precondition: sampling alone picks others
    assert tokens(client, max_tokens=8, temperature=1.0, seed=3, extra_body={"min_p": 1.0}) == (
        greedy
    )


def test_the_largest_seed_samples_and_repeats_itself(client: openai.OpenAI) -> None:
    # seed * stride + step once overflowed the worker's generator: the instance died.
    top = 2**63 - 1
    first = tokens(client, max_tokens=6, temperature=1.0, seed=top, extra_body={"n": 2})
    assert first == tokens(client, max_tokens=6, temperature=1.0, seed=top, extra_body={"n": 2})
    assert first != tokens(client, max_tokens=6, temperature=1.0, seed=top - 1)


def test_bad_words_are_never_generated(client: openai.OpenAI) -> None:
    plain = tokens(client, max_tokens=8)
    word = chr(plain[1])  # an ASCII byte of the greedy output (the first is not)
    assert word.isascii() and word.isprintable()
    banned = tokens(client, max_tokens=8, extra_body={"bad_words": [word]})
    assert plain[1] not in banned and banned[0] == plain[0]
    assert word not in chat_text(client, extra_body={"bad_words": [word]})


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("completions", {"logit_bias": {"tok": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"99999": 1}}, "logit_bias"),  # not in the vocabulary
    ("completions", {"logit_bias": {"1": "up"}}, "logit_bias"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"extra_body": {"min_tokens": 17}}, "min_tokens"),  # over max_tokens 16
    ("completions", {"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ("completions", {"extra_body": {"min_p": 1.5}}, "min_p"),
    ("completions", {"extra_body": {"bad_words": "x"}}, "bad_words"),
    ("completions", {"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
    ("completions", {"extra_body": {"stop_token_ids": [99999]}}, "stop_token_ids"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ("chat", {"logit_bias": {"-1": 5}}, "logit_bias"),
    ("chat", {"max_tokens": 2, "extra_body": {"min_tokens": 3}}, "min_tokens"),
    ("chat", {"presence_penalty": 9}, "presence_penalty"),
]


@pytest.mark.parametrize(("endpoint", "fields", "param"), BAD)
def test_a_bad_value_is_a_400_naming_the_field(
    client: openai.OpenAI, endpoint: str, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        if endpoint == "chat":
            client.chat.completions.create(model="tiny", messages=MESSAGES, **fields)
        else:
            client.completions.create(model="tiny", prompt=PROMPT, **fields)
    assert bad.value.param == param, bad.value.message
    assert "SamplingParams" not in bad.value.message  # the request's names, not the engine's
