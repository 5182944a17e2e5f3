"""Structured output and tools as request fields (api/structured.py): one grammar per request,
a forced tool call's schema as vLLM builds it, the bounds, each refusal naming its field, and
the tools handed to the chat template."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from kvconnect.api.protocol import ApiError, ChatCompletionRequest, CompletionRequest, parse
from kvconnect.api.structured import MAX_SCHEMA_DEPTH, GrammarSpec
from kvconnect.model.tokenizer import ByteTokenizer, render_chat

HI = [{"role": "user", "content": "hi"}]
POINT = {
    "type": "object",
    "properties": {"x": {"$ref": "#/$defs/n"}},
    "$defs": {"n": {"type": "integer"}},
}
TOOLS = [
    {"type": "function", "function": {"name": "move", "parameters": POINT}},
    {"type": "function", "function": {"name": "stop"}},
]


def chat(**fields: Any) -> ChatCompletionRequest:
    return parse(msgspec.json.encode({"messages": HI, **fields}), ChatCompletionRequest)


def refused(kind: type[Any], **fields: Any) -> ApiError:
    base = {"messages": HI} if kind is ChatCompletionRequest else {"prompt": "x"}
    with pytest.raises(ApiError) as e:
        parse(msgspec.json.encode({**base, **fields}), kind)
    return e.value


def test_each_field_gives_its_grammar_on_both_endpoints() -> None:
    for kind in (CompletionRequest, ChatCompletionRequest):
        base = {"messages": HI} if kind is ChatCompletionRequest else {"prompt": "x"}

        def spec(**fields: Any) -> GrammarSpec | None:
            return parse(msgspec.json.encode({**base, **fields}), kind).grammar()  # noqa: B023

        schema = {"type": "object"}
        as_format = {"type": "json_schema", "json_schema": {"name": "o", "schema": schema}}
        assert spec(response_format=as_format) == GrammarSpec(
            "json", json.dumps(schema), "response_format.json_schema"
        )
        assert spec(response_format={"type": "json_object"}) == GrammarSpec(
            "json_object", None, "response_format"
        )
        assert spec(response_format={"type": "text"}) is None
        assert spec(structured_outputs={"json": '{"type": "string"}'}).value == (  # type: ignore[union-attr]
            '{"type": "string"}'
        )
        assert spec(structured_outputs={"choice": ["a", "b"]}) == GrammarSpec(
            "choice", ("a", "b"), "structured_outputs.choice"
        )
        assert spec(structured_outputs={"regex": "a+"}).param == "structured_outputs.regex"  # type: ignore[union-attr]


def test_forced_tool_calls_are_vllms_schemas() -> None:
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "move"}})
    assert named.forced_tool == "move"
    assert json.loads(named.grammar().value) == POINT  # type: ignore[arg-type, union-attr]
    required = chat(tools=TOOLS, tool_choice="required")
    assert required.forced_tool == ""
    spec = required.grammar()
    assert spec is not None and spec.param == "tools"
    schema = json.loads(spec.value)  # type: ignore[arg-type]
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert schema["$defs"] == {"n": {"type": "integer"}}  # hoisted from the tools' parameters
    first, second = schema["items"]["anyOf"]
    assert first["properties"]["name"] == {"type": "string", "enum": ["move"]}
    assert "$defs" not in first["properties"]["parameters"]
    assert second["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert first["required"] == ["name", "parameters"]
    plain = chat(tools=TOOLS, tool_choice="none")
    assert plain.forced_tool is None and plain.grammar() is None
    assert plain.tool_dicts() == [
        {"type": "function", "function": {"name": "move", "parameters": POINT}},
        {"type": "function", "function": {"name": "stop"}},
    ]


def deep(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(levels - 1):
        schema = {"anyOf": [schema]}
    return schema


COMPLETION, CHAT = CompletionRequest, ChatCompletionRequest
MOVE = {"type": "function", "function": {"name": "move"}}
DEEP_TOOL = [{"type": "function", "function": {"name": "f", "parameters": deep(80)}}]
JSON_OBJECT = {"type": "json_object"}


def so(**spec: Any) -> dict[str, Any]:
    return {"structured_outputs": spec}


@pytest.mark.parametrize(
    ("kind", "fields", "param"),
    [
        (COMPLETION, so(), "structured_outputs"),
        (COMPLETION, so(regex="a", grammar="b"), "structured_outputs"),
        (COMPLETION, so(choice=["x" * 1000] * 17), "structured_outputs.choice"),
        (COMPLETION, so(json=deep(MAX_SCHEMA_DEPTH + 1)), "structured_outputs.json"),
        (COMPLETION, so(json="[" * 5000), "structured_outputs.json"),
        (CHAT, {"response_format": {"type": "xml"}}, "response_format.type"),
        (CHAT, {"response_format": JSON_OBJECT, **so(regex="a")}, "structured_outputs.regex"),
        (CHAT, {"tools": TOOLS}, "tool_choice"),
        (CHAT, {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (CHAT, {"tool_choice": MOVE}, "tool_choice"),
        (
            CHAT,
            {"tools": TOOLS, "tool_choice": "required", "response_format": JSON_OBJECT},
            "tools",
        ),
        (CHAT, {"tools": DEEP_TOOL, "tool_choice": "required"}, "tools"),
    ],
)
def test_a_request_that_asks_too_much_is_a_400_naming_the_field(
    kind: type[Any], fields: dict[str, Any], param: str
) -> None:
    assert refused(kind, **fields).param == param


def test_tools_reach_the_chat_template_which_may_ignore_them() -> None:
    request = chat(tools=TOOLS, tool_choice="required")
    shows = "{% for t in tools %}{{ t.function.name }};{% endfor %}{{ messages[0].content }}"
    assert render_chat(shows, request.conversation(), tools=request.tool_dicts()) == "move;stop;hi"
    ignores = ByteTokenizer()  # the byte model's template, like SmolLM2's, has no tools
    assert ignores.apply_chat_template(HI, tools=request.tool_dicts()) == (
        ignores.apply_chat_template(HI)
    )
