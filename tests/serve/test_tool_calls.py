"""A forced tool call's output as OpenAI's tool_calls (serve/tool_calls.py): whole, and as
stream deltas that join to the same calls however the text is cut."""

from __future__ import annotations

import json
import random
from typing import Any

from kvconnect.serve.tool_calls import ToolCallStream, finish_reason, whole_calls

CALLS = [
    {"name": "move", "parameters": {"to": 'a "quoted" } ] { [ brace', "by": [1, {"z": None}]}},
    {"name": "stop", "parameters": {}},
]
TEXT = ' [ {"name": "move", "parameters": ' + json.dumps(CALLS[0]["parameters"]) + " },\n"
TEXT += '{"name":"stop","parameters":{}}]'


def joined(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls a client builds from the deltas: the first of an index, then its arguments."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if d["index"] not in calls:
            calls[d["index"]] = json.loads(json.dumps(d))
        else:
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


def test_required_calls_whole_and_streamed_in_any_cut_are_the_same() -> None:
    whole = whole_calls("", TEXT)
    assert whole is not None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole] == [
        (c["name"], c["parameters"]) for c in CALLS
    ]
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in whole)
    rng = random.Random(3)
    for _ in range(50):
        stream, deltas, at = ToolCallStream(""), [], 0
        while at < len(TEXT):
            step = rng.randrange(1, 8)
            deltas += stream.feed(TEXT[at : at + step])
            at += step
        calls = joined(deltas)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in whole
        ]
        assert [c["index"] for c in calls] == [0, 1]
    assert finish_reason("", "stop", True) == "tool_calls"
    assert finish_reason("", "length", True) == "length"


def test_a_named_call_streams_its_arguments_text() -> None:
    stream = ToolCallStream("move")
    deltas = stream.feed('{"to":') + stream.feed("") + stream.feed(' "x"}')
    first, rest = deltas[0], deltas[1:]
    assert first["function"] == {"name": "move", "arguments": '{"to":'} and "id" in first
    assert rest == [{"index": 0, "function": {"arguments": ' "x"}'}}]
    joined_calls = joined(deltas)
    assert joined_calls[0]["function"]["arguments"] == '{"to": "x"}'
    (whole,) = whole_calls("move", '{"to": "x"}') or []
    assert whole["function"] == joined_calls[0]["function"]  # whole: the output as it is
    assert finish_reason("move", "stop", True) == "stop"  # OpenAI's for a named function


def test_an_output_cut_short_is_not_a_call() -> None:
    assert whole_calls("", TEXT[:40]) is None
    assert whole_calls("", '{"name": "x"}') is None
    assert whole_calls("", "[1, 2]") is None
