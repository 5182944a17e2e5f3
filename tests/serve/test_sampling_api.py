"""The sampling controls through the OpenAI Python client, on completions and chat, against
`kvconnect serve` and the router in front: presence/frequency/repetition penalties,
logit_bias, and vLLM's min_p, min_tokens and bad_words change the output as they should, and
a bad value is a 400 naming the request's field.

Structured output and forced tool calls (a grammar's bitmask in the same sampler) are tested
here too, on the same two servers: random weights under a grammar still write only what the
grammar allows, so every output parses, validates against its schema, matches its regex, is
one of its choices; tool calls validate against their tool's parameters, streamed or not."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvconnect.model.tokenizer import BYTE_EOS
from tests.engine.test_sampler_extremes import controls
from tests.serving import RouterProcess, Serve, get, post

pytestmark = pytest.mark.slow

PROMPT = "Hello"
MESSAGES: Any = [{"role": "user", "content": "Hello"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"],
    }}},
]  # fmt: skip


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


def api_body(fields: dict[str, Any]) -> dict[str, Any]:
    """The sampler-level test's controls as a completions body (logit_bias keys are strings
    in the API; its token-id bad words have no API form)."""
    body = {k: v for k, v in fields.items() if k != "bad_words_token_ids"}
    if "logit_bias" in body:
        body["logit_bias"] = {str(t): b for t, b in body["logit_bias"].items()}
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, **body}


def send_together(url: str, bodies: list[dict[str, Any]]) -> list[tuple[int, Any]]:
    """The bodies sent at once (so the engine batches them), each answer's status and body;
    json.dumps writes NaN and Infinity, as a careless client would."""
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = pool.map(lambda b: post(url + "/v1/completions", b)[:2], bodies)
        return list(answers)


@example(requests=[{"temperature": 1.0, "top_p": 1e-320}])  # issue 35: it killed the instance
@example(requests=[{"temperature": 1.0, "top_k": 2**63}])  # so did this (a long overflows)
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(requests=st.lists(controls, min_size=1, max_size=6))
def test_extreme_sampling_values_get_an_answer_or_a_400_and_serve_stays_up(
    served: tuple[Serve, RouterProcess], requests: list[dict[str, Any]]
) -> None:
    url = served[0].url
    for (status, body), fields in zip(
        send_together(url, [api_body(f) for f in requests]), requests, strict=True
    ):
        assert status in (200, 400), (fields, status, body)
        if status == 200:
            assert len(body["choices"][0]["text"]) >= 0 and body["usage"]["completion_tokens"]
        else:
            assert body["error"]["message"], body
    assert get(url + "/health")[0] == 200


def test_bad_words_are_never_generated(client: openai.OpenAI) -> None:
    plain = tokens(client, max_tokens=8)
    word = chr(plain[1])  # an ASCII byte of the greedy output (the first is not)
    assert word.isascii() and word.isprintable()
    banned = tokens(client, max_tokens=8, extra_body={"bad_words": [word]})
    assert plain[1] not in banned and banned[0] == plain[0]
    assert word not in chat_text(client, extra_body={"bad_words": [word]})


def outputs(**spec: Any) -> dict[str, Any]:
    return {"extra_body": {"structured_outputs": spec}}


def schema_format(schema: Any) -> dict[str, Any]:
    return {
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    }


def named(name: str) -> Any:
    return {"type": "function", "function": {"name": name}}


def tool(name: str, parameters: Any = None) -> Any:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


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
    ("chat", schema_format({"type": 5}), "response_format.json_schema"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ("completions", outputs(regex="a("), "structured_outputs.regex"),
    ("completions", outputs(grammar="root ::= "), "structured_outputs.grammar"),
    ("completions", outputs(json="{oops"), "structured_outputs.json"),
    ("completions", outputs(choice=[]), "structured_outputs.choice"),
    ("completions", outputs(regex="a", choice=["a"]), "structured_outputs"),
    ("chat", {**outputs(regex="a"), "response_format": {"type": "json_object"}},
     "structured_outputs.regex"),
    ("chat", {"tools": TOOLS}, "tool_choice"),  # "auto": no tool call parser
    ("chat", {"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),  # without tools
    ("chat", {"tools": TOOLS, "tool_choice": named("nope")}, "tool_choice"),
    ("chat", {"tools": [tool("bad name!")], "tool_choice": "required"}, "tools[0].function.name"),
    ("chat", {"tools": [tool("f", {"type": 5})], "tool_choice": "required"}, "tools"),
]  # fmt: skip


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


# -- structured output and tools ---------------------------------------------------------------

SAMPLED: dict[str, Any] = {"temperature": 1.0, "seed": 7, "max_tokens": 400}
"""Random weights at temperature 1: greedy would write whitespace until max_tokens (which the
JSON grammars allow anywhere, as in vLLM); drawn, they end by themselves."""


def parsed(text: str) -> Any:
    # xgrammar lets raw control characters into strings it bounds (maxLength), which a strict
    # parser refuses; they are only ever inside strings.
    return json.loads(text, strict=False)


def test_json_object_and_json_schema_outputs_parse_and_validate(client: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    reply = client.chat.completions.create(
        model="tiny", messages=MESSAGES, response_format=fmt, n=3, **SAMPLED
    )
    texts = [c.message.content or "" for c in reply.choices]
    chunks = client.chat.completions.create(
        model="tiny", messages=MESSAGES, response_format=fmt, stream=True, **SAMPLED
    )
    texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    assert texts[-1] == texts[0]  # the same seed, streamed
    for text in texts:
        jsonschema.validate(parsed(text), WEATHER)
    # Any object: a nudge towards "}" keeps random weights from nesting past max_tokens.
    whole = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        logit_bias={str(ord("}")): 4},
        extra_body={"response_format": {"type": "json_object"}},
        **SAMPLED,
    )
    assert whole.choices[0].finish_reason == "stop"
    assert isinstance(parsed(whole.choices[0].text), dict)


def test_regex_choice_and_grammar_hold_on_both_endpoints(client: openai.OpenAI) -> None:
    cases: list[tuple[dict[str, Any], Any]] = [
        ({"regex": r"[a-z]{3}-[0-9]{2,4}"}, lambda t: re.fullmatch(r"[a-z]{3}-[0-9]{2,4}", t)),
        ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        ({"grammar": 'root ::= "x" [0-9]+ ("," [0-9]+)* "y"'},
         lambda t: re.fullmatch(r"x[0-9]+(,[0-9]+)*y", t)),
    ]  # fmt: skip
    for spec, holds in cases:
        body = {"structured_outputs": spec}
        done = client.completions.create(
            model="tiny", prompt=PROMPT, n=3, extra_body=body, **SAMPLED
        )
        chat = client.chat.completions.create(
            model="tiny", messages=MESSAGES, extra_body=body, **SAMPLED
        )
        texts = [c.text for c in done.choices] + [chat.choices[0].message.content or ""]
        assert all(holds(t) for t in texts), (spec, texts)
        assert {c.finish_reason for c in done.choices} == {"stop"}


def check_calls(calls: list[Any], names: set[str]) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert call.function.name in names
        jsonschema.validate(parsed(call.function.arguments), schemas[call.function.name])


def streamed_calls(client: openai.OpenAI, **fields: Any) -> tuple[list[Any], str | None]:
    """The tool calls of a streamed reply, joined from their deltas (as a client does)."""
    calls: dict[int, Any] = {}
    finish = None
    for chunk in client.chat.completions.create(
        model="tiny", messages=MESSAGES, stream=True, **SAMPLED, **fields
    ):
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for d in chunk.choices[0].delta.tool_calls or []:
            if d.index not in calls:
                calls[d.index] = d.model_copy(deep=True)
            else:
                calls[d.index].function.arguments += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


def test_forced_tool_calls_are_valid_for_their_tools_whole_and_streamed(
    client: openai.OpenAI,
) -> None:
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    for choice, names, finish in (("required", {"get_weather", "get_time"}, "tool_calls"),
                                  (named, {"get_weather"}, "stop")):  # fmt: skip
        reply = client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice, **SAMPLED
        )
        message = reply.choices[0].message
        assert message.content == "" and reply.choices[0].finish_reason == finish
        check_calls(message.tool_calls or [], names)
        calls, streamed_finish = streamed_calls(client, tools=TOOLS, tool_choice=choice)
        assert streamed_finish == finish
        check_calls(calls, names)
        assert [(c.function.name, parsed(c.function.arguments)) for c in calls] == [
            (c.function.name, parsed(c.function.arguments)) for c in message.tool_calls or []
        ]  # the same seed: the same calls, streamed or not
    none = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=4
    )
    assert none.choices[0].message.tool_calls is None
