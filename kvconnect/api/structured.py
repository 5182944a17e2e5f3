"""What a request says its output must be: structured output and tools, as request fields.

    response_format      OpenAI's: {"type": "text" | "json_object" | "json_schema",
                         "json_schema": {"name", "schema", "strict", "description"}}
    structured_outputs   vLLM's: exactly one of "json" (a schema), "json_object", "regex",
                         "choice" (strings), "grammar" (EBNF)
    tools, tool_choice   OpenAI's (chat only): function tools; "none", "auto", "required" or
                         {"type": "function", "function": {"name"}}

`grammar_spec(...)` turns them into one `GrammarSpec` (or None): the kind of grammar, its text,
and the request field a refusal names. A tool choice of "required" or a named function is a
JSON schema built from the tools' parameters, as vLLM builds it: the named function's
parameters, or for "required" an array of at least one {"name", "parameters"} object, one
alternative per tool. Whether a schema, regex or grammar compiles is the engine's to say
(serve/prepare.py asks it before anything runs); this module checks shapes only, so the router
(which imports no engine) reads the same fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

MAX_TOOLS = 128
MAX_CHOICES = 256
MAX_CHOICES_CHARS = 16 << 10
"""All choices together at most: compiling them grows with their text (256 choices of 4 KiB
took 52 s here; 16 KiB takes about 0.2 s)."""
MAX_SCHEMA_DEPTH = 64
"""Nesting of a JSON schema at most: xgrammar's compile time grows steeply with depth (300
levels took 1.7 s here, 950 levels 128 s), and a request must not buy minutes of CPU."""
ToolName = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
"""OpenAI's rule for a function name."""
Choice = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
Choices = Annotated[list[Choice], msgspec.Meta(min_length=1, max_length=MAX_CHOICES)]
GrammarText = Annotated[str, msgspec.Meta(min_length=1, max_length=16 << 10)]


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str = "response"
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, kw_only=True):
    """vLLM's `structured_outputs` (its other fields, backend options, are not taken)."""

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: GrammarText | None = None
    choice: Choices | None = None
    grammar: GrammarText | None = None


class FunctionDefinition(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct):
    type: Literal["function"]
    function: NamedFunction


Tools = Annotated[list[Tool], msgspec.Meta(max_length=MAX_TOOLS)]
ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class GrammarSpec:
    """The one grammar a request's output follows."""

    kind: Literal["json", "json_object", "regex", "choice", "grammar"]
    value: str | tuple[str, ...] | None
    """The schema as JSON text, the regex, the choices or the grammar; None for json_object."""
    param: str
    """The request field a refusal names."""


class SpecError(ValueError):
    """A request's output fields do not fit together; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def from_response_format(fmt: ResponseFormat) -> GrammarSpec | None:
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GrammarSpec("json_object", None, "response_format")
    if fmt.json_schema is None or fmt.json_schema.schema is None:
        raise SpecError(
            'response_format of type "json_schema" needs json_schema.schema',
            "response_format.json_schema",
        )
    param = "response_format.json_schema"
    return GrammarSpec("json", schema_text(fmt.json_schema.schema, param), param)


def from_structured_outputs(so: StructuredOutputs) -> GrammarSpec:
    given = [k for k in ("json", "regex", "choice", "grammar") if getattr(so, k) is not None]
    given += ["json_object"] if so.json_object else []
    if len(given) != 1:
        raise SpecError(
            "structured_outputs: exactly one of json, json_object, regex, choice, grammar must "
            f"be set, not {given or 'none'}",
            "structured_outputs",
        )
    kind = given[0]
    param = f"structured_outputs.{kind}"
    if kind == "json":
        assert so.json is not None
        return GrammarSpec("json", schema_text(so.json, param), param)
    if kind == "json_object":
        return GrammarSpec("json_object", None, param)
    if kind == "choice":
        assert so.choice is not None
        if sum(len(c) for c in so.choice) > MAX_CHOICES_CHARS:
            raise SpecError(f"{param}: more than {MAX_CHOICES_CHARS} characters in all", param)
        return GrammarSpec("choice", tuple(so.choice), param)
    value = getattr(so, kind)
    return GrammarSpec(kind, value, param)  # type: ignore[arg-type]


def tool_schema(tools: list[Tool], choice: ToolChoice | None) -> dict[str, Any] | None:
    """The JSON schema a tool call must follow (vLLM's `_get_json_schema_from_tool`); None
    unless the choice is "required" or a named function. `SpecError` naming tool_choice for
    a function that is not among the tools."""
    if isinstance(choice, NamedToolChoice):
        found = next((t for t in tools if t.function.name == choice.function.name), None)
        if found is None:
            raise SpecError(
                f"tool_choice names the function {choice.function.name!r}, which is not in tools",
                "tool_choice",
            )
        return _parameters(found)
    if choice != "required":
        return None
    defs: dict[str, Any] = {}
    alternatives = []
    for tool in tools:
        params = dict(_parameters(tool))
        for name, schema in params.pop("$defs", {}).items():
            if name in defs and defs[name] != schema:
                raise SpecError(f"tools: two different $defs named {name!r}", "tools")
            defs[name] = schema
        alternatives.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": params,
                },
                "required": ["name", "parameters"],
            }
        )
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": alternatives}}
    return {**schema, "$defs": defs} if defs else schema


def _parameters(tool: Tool) -> dict[str, Any]:
    params = tool.function.parameters or {"type": "object", "properties": {}}
    schema_text(params, "tools")  # its depth
    return params


def schema_text(schema: dict[str, Any] | str, param: str) -> str:
    """A schema as JSON text, `SpecError` naming `param` if it nests deeper than
    MAX_SCHEMA_DEPTH (text that is not JSON is left for the compiler to name)."""
    too_deep = SpecError(f"{param}: the schema nests deeper than {MAX_SCHEMA_DEPTH} levels", param)
    try:
        value = json.loads(schema) if isinstance(schema, str) else schema
    except ValueError:
        return str(schema)
    except RecursionError:
        raise too_deep from None
    if depth(value) > MAX_SCHEMA_DEPTH:
        raise too_deep
    return json.dumps(value)


def depth(value: Any) -> int:
    """How deep lists and dicts nest in `value` (no recursion: any depth is measured)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = (
            item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        )
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in children)
    return deepest


def grammar_spec(
    response_format: ResponseFormat | None,
    structured_outputs: StructuredOutputs | None,
    tools: list[Tool] | None = None,
    tool_choice: ToolChoice | None = None,
) -> GrammarSpec | None:
    """The request's one grammar, or None; `SpecError` if it asks for two."""
    specs: list[GrammarSpec] = []
    if response_format is not None and (spec := from_response_format(response_format)):
        specs.append(spec)
    if structured_outputs is not None:
        specs.append(from_structured_outputs(structured_outputs))
    if tools and (schema := tool_schema(tools, tool_choice)) is not None:
        specs.append(GrammarSpec("json", json.dumps(schema), "tools"))
    if len(specs) > 1:
        names = " and ".join(s.param.split(".")[0] for s in specs)
        raise SpecError(f"{names} each constrain the output: give one", specs[-1].param)
    return specs[0] if specs else None


__all__ = [
    "FunctionDefinition",
    "GrammarSpec",
    "NamedToolChoice",
    "ResponseFormat",
    "SpecError",
    "StructuredOutputs",
    "Tool",
    "ToolChoice",
    "Tools",
    "grammar_spec",
    "tool_schema",
]
