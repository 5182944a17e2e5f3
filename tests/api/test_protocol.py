"""Request validation: every field typed and bounded, errors in OpenAI's shape naming it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvconnect.api.protocol import (
    MAX_BODY_BYTES,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    parse,
)


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def refused(raw: bytes, kind: Any = CompletionRequest) -> ApiError:
    with pytest.raises(ApiError) as e:
        request = parse(raw, kind)
        if isinstance(request, CompletionRequest):
            request.prompts()
        else:
            request.conversation()
    return e.value


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": "x", "max_tokens": "4"}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 4.5}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 10**30}, "max_tokens"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "top_k": -2}, "top_k"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "n": 1000}, "n"),
        ({"prompt": "x", "seed": -1}, "seed"),
        ({"prompt": "x", "stop": [""]}, "stop[0]"),
        ({"prompt": "x", "stop": ["a"] * 100}, "stop"),
        ({"prompt": "x", "stop": 7}, "stop"),
        ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids[0]"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "logprobs": True}, "logprobs"),
        ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "x", "min_p": 1.5}, "min_p"),
        ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
        ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"-3": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"3": "up"}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": [3]}, "logit_bias"),
        ({"prompt": "x", "bad_words": "no"}, "bad_words"),
        ({"prompt": "x", "echo": "yes"}, "echo"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": 123}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1.5, 2]}, "prompt"),
        ({"prompt": [True]}, "prompt"),
        ({"prompt": ["a", 1]}, "prompt"),
        ({"prompt": [[1, 2], []]}, "prompt"),
        ({"prompt": [-5]}, "prompt"),
        ({}, "prompt"),
    ],
)
def test_a_bad_field_is_a_400_naming_it(fields: dict[str, Any], param: str) -> None:
    error = refused(body(**fields))
    assert error.status == 400 and error.param == param
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}
    assert error.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b'{"prompt": "x"', b"\xff\xfe", b"[]", b"null", b'"prompt"', b"{'a': 1}"],
)
def test_not_json_or_not_an_object_is_a_400(raw: bytes) -> None:
    error = refused(raw)
    assert error.status == 400 and error.message


def test_a_huge_number_is_a_400_not_a_crash() -> None:
    assert refused(b'{"prompt": "x", "max_tokens": 1e400}').param == "max_tokens"
    assert refused(b'{"prompt": "x", "temperature": 1e400}').param == "temperature"


def test_a_body_over_the_limit_is_a_413() -> None:
    assert refused(b" " * (MAX_BODY_BYTES + 1)).status == 413


def test_the_four_prompt_shapes_and_unknown_fields() -> None:
    def prompts(p: Any) -> list[Any]:
        return parse(body(prompt=p, future_field={"x": 1}), CompletionRequest).prompts()

    assert prompts("hi") == ["hi"]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([1, 2, 3]) == [[1, 2, 3]]
    assert prompts([[1], [2, 3]]) == [[1], [2, 3]]
    req = parse(
        body(prompt="x", stop="\n", stream=True, stream_options={"include_usage": True}),
        CompletionRequest,
    )
    assert req.stops == ("\n",) and req.include_usage


def test_chat_messages_roles_text_parts_and_unsupported_features() -> None:
    ok = parse(
        body(
            messages=[
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
            max_completion_tokens=5,
        ),
        ChatCompletionRequest,
    )
    assert ok.conversation() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
    ]
    assert ok.completion_tokens == 5
    kind = ChatCompletionRequest
    assert refused(body(messages=[]), kind).param == "messages"
    assert refused(body(messages=[{"role": "wizard", "content": "x"}]), kind).param == (
        "messages[0].role"
    )
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    assert refused(body(messages=[{"role": "user", "content": image}]), kind).param == (
        "messages[0].content"
    )
    assert refused(body(messages=[{"role": "user", "content": "x"}], tools=[{}]), kind).param == (
        "tools[0]"
    )
    assert refused(body(messages=[{"role": "user"}], max_tokens=0), kind).param == "max_tokens"


def test_logprobs_and_sampling_controls_take_vllms_names_and_bounds() -> None:
    chat = ChatCompletionRequest
    hi = [{"role": "user", "content": "hi"}]
    ok = parse(body(messages=hi, logprobs=True, top_logprobs=20), chat)
    assert (ok.logprobs, ok.top_logprobs) == (True, 20)
    assert refused(body(messages=hi, logprobs=True, top_logprobs=21), chat).param == (
        "top_logprobs"
    )
    assert refused(body(messages=hi, top_logprobs=2), chat).param == "top_logprobs"
    assert refused(body(messages=hi, logprobs=3), chat).param == "logprobs"
    assert parse(body(messages=hi, top_logprobs=0), chat).top_logprobs == 0
    req = parse(
        body(prompt="x", logprobs=20, echo=True, logit_bias={"7": 250, "8": -1e9, "9": 0.5}),
        CompletionRequest,
    )
    assert req.token_biases() == {7: 100.0, 8: -100.0, 9: 0.5}  # clamped, as vLLM
    assert parse(body(prompt="x", logit_bias={}), CompletionRequest).token_biases() is None
    both = parse(body(messages=hi, min_p=0.1, min_tokens=2, bad_words=["a b"]), chat)
    assert (both.min_p, both.min_tokens, both.bad_words) == (0.1, 2, ["a b"])
