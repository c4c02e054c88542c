"""Tool calling on /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls` checked
and turned into what the request does.

- `none` (the default without tools): tools still reach the template; the answer is plain text.
- `auto` (the default with tools): the model decides; the tool-call parser (`--tool-call-parser`,
  `auto`: the chat template's format) reads its answer. Without a parser: 400, never a silent
  plain reply.
- `required` / a named function: enforced by structured outputs, as vLLM does — the grammar is
  a JSON schema (named: the function's parameters; required: an array of `{"name", "parameters"}`
  calls, at most one when `parallel_tool_calls` is false), so even a random-weight model returns
  a valid call.

Function tools only; each tool is checked field by field (nothing silently ignored). `strict:
true` is honoured by `required` and a named function (the grammar is the schema); under `auto`
the model may answer in text, so a schema cannot be enforced there: 400.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal, NamedTuple

from himamba.common.types import GrammarSpec
from himamba.services.tokenizer.http.errors import ApiError

ToolMode = Literal["none", "auto", "required", "named"]
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_TOOL_FIELDS = {"type", "function"}
_FUNCTION_FIELDS = {"name", "description", "parameters", "strict"}
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class ToolPlan(NamedTuple):
    """What a chat request's tool fields ask for."""

    mode: ToolMode
    name: str | None = None  # the named function
    grammar: GrammarSpec | None = None  # required / named: the constraint
    parser: str | None = None  # auto: the tool-call parser's format
    max_calls: int | None = None  # 1 when parallel_tool_calls is false


def _check_tools(tools: list[Any]) -> dict[str, dict[str, Any]]:
    """The functions by name; a 400 naming the first thing wrong."""
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ApiError(400, f"{where} must be an object", param="tools")
        if tool.get("type") != "function":
            raise ApiError(400, f'{where}.type must be "function" (the only tool type supported)', param="tools")
        unknown = sorted(set(tool) - _TOOL_FIELDS)
        if unknown:
            raise ApiError(400, f"{where}: unrecognized field {unknown[0]!r}", param="tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ApiError(400, f"{where}.function must be an object", param="tools")
        unknown = sorted(set(fn) - _FUNCTION_FIELDS)
        if unknown:
            raise ApiError(400, f"{where}.function: unrecognized field {unknown[0]!r}", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ApiError(
                400, f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}", param="tools"
            )
        if name in functions:
            raise ApiError(400, f"{where}.function.name: {name!r} is defined twice", param="tools")
        if not isinstance(fn.get("description", ""), str):
            raise ApiError(400, f"{where}.function.description must be a string", param="tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ApiError(400, f"{where}.function.parameters must be a JSON schema object", param="tools")
        if not isinstance(fn.get("strict", False), (bool, type(None))):
            raise ApiError(400, f"{where}.function.strict must be a boolean", param="tools")
        functions[name] = fn
    return functions


def _parameters(fn: dict[str, Any]) -> dict[str, Any]:
    params = fn.get("parameters")
    return params if isinstance(params, dict) and params else dict(_EMPTY_PARAMETERS)


def required_schema(functions: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The answer of tool_choice "required": an array of calls to the given functions."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": _parameters(fn)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, fn in functions.items()
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _named(choice: dict[str, Any]) -> str:
    fn = choice.get("function")
    if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(
            400,
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    extra = sorted((set(choice) - {"type", "function"}) | (set(fn) - {"name"}))
    if extra:
        raise ApiError(400, f"tool_choice: unrecognized field {extra[0]!r}", param="tool_choice")
    return fn["name"]


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool, parser: str | None) -> ToolPlan:
    """Check a chat request's tool fields; `parser` is the server's tool-call format (None: none)."""
    functions = _check_tools(tools) if tools else {}
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if tool_choice == "none":
        return ToolPlan("none")
    if not functions:
        raise ApiError(400, 'tool_choice other than "none" needs tools', param="tool_choice")
    max_calls = None if parallel_tool_calls else 1
    if tool_choice == "auto":
        strict = [i for i, fn in enumerate(functions.values()) if fn.get("strict")]
        if strict:
            raise ApiError(
                400,
                f'tools[{strict[0]}].function.strict: true is enforced only under tool_choice "required" or a named '
                'function (under "auto" the model may answer in text); send one of those, or strict: false',
                param="tools",
            )
        if parser is None:
            raise ApiError(
                400,
                'tool_choice "auto" needs a tool-call parser, and this server has none for its chat template '
                "(start it with --tool-call-parser hermes, nemotron_json, qwen3_coder, llama3_json, mistral, pythonic "
                "or granite), or send tool_choice "
                '"required", a named function, or "none"',
                param="tool_choice",
            )
        return ToolPlan("auto", parser=parser, max_calls=max_calls)
    if tool_choice == "required":
        schema = required_schema(functions, parallel_tool_calls)
        return ToolPlan(
            "required", grammar=GrammarSpec(kind="json_schema", spec=json.dumps(schema)), max_calls=max_calls
        )
    if isinstance(tool_choice, dict):
        name = _named(tool_choice)
        if name not in functions:
            raise ApiError(400, f"tool_choice names function {name!r}, which is not in tools", param="tool_choice")
        schema = _parameters(functions[name])
        return ToolPlan("named", name=name, grammar=GrammarSpec(kind="json_schema", spec=json.dumps(schema)))
    raise ApiError(
        400,
        f'tool_choice must be "none", "auto", "required" or a named function, got {tool_choice!r}',
        param="tool_choice",
    )
