"""A forced tool call's output as OpenAI's `tool_calls`, whole and streamed.

With tool_choice "required" or a named function the output follows a JSON schema
(api/structured.py), so it is read here without guessing:

    named       the output is the function's arguments:
                [{"id", "type": "function", "function": {"name", "arguments": <the output>}}]
    required    the output is [{"name": ..., "parameters": {...}}, ...]: one call per element,
                its parameters as the arguments' JSON text

finish_reason as OpenAI and vLLM give it: "tool_calls" for "required" (when the output ended
by itself), "stop" for a named function. An output cut short (max_tokens) that is not a whole
array of calls is left as text content, with its finish_reason ("length").

Streamed: a named call's first delta carries the id, type and name with the first arguments
text, later deltas only more arguments text; with "required" each call is sent whole in one
delta once its element of the array is complete (its arguments are then known to be JSON).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_call(index: int | None, name: str, arguments: str) -> dict[str, Any]:
    call: dict[str, Any] = {
        "id": tool_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }
    return call if index is None else {"index": index, **call}


def finish_reason(forced: str, reason: str | None, called: bool) -> str | None:
    """ "tool_calls" for "required" ("" here) that made its calls and ended by itself."""
    return "tool_calls" if called and forced == "" and reason == "stop" else reason


def whole_calls(forced: str, text: str) -> list[dict[str, Any]] | None:
    """The calls in a finished output; None if it is not a whole array of calls."""
    if forced:
        return [tool_call(None, forced, text)]
    try:
        calls = json.loads(text, strict=False)
    except ValueError:
        return None
    if not isinstance(calls, list) or not all(
        isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls
    ):
        return None
    return [
        tool_call(None, c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False))
        for c in calls
    ]


@dataclass
class ToolCallStream:
    """One choice's calls as stream deltas, from its output text piece by piece."""

    forced: str
    """The named function, or "" for "required"."""
    started: bool = False
    num_calls: int = 0
    _scan: _ArrayScan = field(default_factory=lambda: _ArrayScan())

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The `tool_calls` deltas this piece of output completes."""
        if self.forced:
            if not text and self.started:
                return []
            first, self.started = not self.started, True
            if first:
                return [tool_call(0, self.forced, text)]
            return [{"index": 0, "function": {"arguments": text}}]
        deltas = []
        for element in self._scan.feed(text):
            name, arguments = _call_of(element)
            if name is None:
                continue
            deltas.append(tool_call(self.num_calls, name, arguments))
            self.num_calls += 1
        return deltas

    @property
    def called(self) -> bool:
        return self.started or self.num_calls > 0


def _call_of(element: str) -> tuple[str | None, str]:
    try:
        call = json.loads(element, strict=False)
    except ValueError:
        return None, ""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None, ""
    return call["name"], json.dumps(call.get("parameters", {}), ensure_ascii=False)


@dataclass
class _ArrayScan:
    """The elements of a top-level JSON array, each as soon as its text is complete: tracks
    depth, strings and escapes character by character."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    current: list[str] = field(default_factory=list)

    def feed(self, text: str) -> list[str]:
        done: list[str] = []
        for ch in text:
            if self.depth >= 2 or (self.depth == 1 and ch not in " \t\r\n,]"):
                self.current.append(ch)
            if self.in_string:
                self._string_char(ch)
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1:
                    done.append("".join(self.current))
                    self.current = []
        return done

    def _string_char(self, ch: str) -> None:
        if self.escaped:
            self.escaped = False
        elif ch == "\\":
            self.escaped = True
        elif ch == '"':
            self.in_string = False


__all__ = ["ToolCallStream", "finish_reason", "tool_call", "tool_call_id", "whole_calls"]
