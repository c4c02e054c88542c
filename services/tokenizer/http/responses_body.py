"""The /v1/responses request body, and its translation into a chat request.

A Responses request is a chat request in other words: `input` items become chat messages
(`developer` is the template's `system`; a `function_call` item is an assistant tool call, a
`function_call_output` a `tool` message; `reasoning` items are dropped, as templates drop past
thinking), `instructions` a leading system message, flat function tools and `tool_choice` the chat
shapes, `text.format` the chat `response_format`. Everything after that (template, tool plan,
grammar, sampling, parsers) is the chat endpoint's own code.

Refused with a 400 naming the field, because nothing here would do what they ask: built-in tools
(web_search, file_search, ...), `conversation` and `prompt` (OpenAI-hosted objects), `include`
entries, `top_logprobs`, `max_tool_calls`, `truncation: "auto"` (a prompt too long is a 400),
images and files.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from himamba.services.tokenizer.http.bodies import ChatBody
from himamba.services.tokenizer.http.errors import ApiError
from himamba.services.tokenizer.http.responses_output import item_id


class ResponsesStreamOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`stream_options` of /v1/responses."""

    include_obfuscation: bool = True  # OpenAI pads events against side channels; accepted without effect


class ResponsesBody(msgspec.Struct, frozen=True, kw_only=True):
    """POST /v1/responses. Items and tools stay plain JSON: they are checked item by item below."""

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    reasoning: dict[str, Any] | None = None  # effort / summary: accepted without effect
    stream_options: ResponsesStreamOptions | None = None
    background: bool = False
    logit_bias: dict[str, float] | None = None  # extension (chat's): token id -> bias in [-100, 100]
    # known, refused unless at the value that means what we do
    truncation: Literal["disabled", "auto"] = "disabled"
    include: list[str] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    conversation: Any = None
    prompt: Any = None


_MESSAGE_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_ITEM_FIELDS = {
    "message": {"type", "role", "content", "id", "status"},
    "function_call": {"type", "id", "call_id", "name", "arguments", "status"},
    "function_call_output": {"type", "id", "call_id", "output", "status"},
    "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"},
}
_TEXT_PARTS = {"input_text", "output_text"}
_PART_FIELDS = {"type", "text", "annotations", "logprobs"}
_FUNCTION_TOOL_FIELDS = {"type", "name", "description", "parameters", "strict"}


def check_refused(body: ResponsesBody) -> None:
    """A 400 naming the first field asked for that this server does not do."""
    refusals = (
        (body.truncation == "auto", "truncation", 'truncation "auto" is not supported: a prompt too long is a 400'),
        (bool(body.include), "include", "include is not supported: no extra output data is available"),
        (bool(body.top_logprobs), "top_logprobs", "top_logprobs is not supported on /v1/responses"),
        (
            body.max_tool_calls is not None,
            "max_tool_calls",
            "max_tool_calls is not supported (see parallel_tool_calls)",
        ),
        (
            body.conversation is not None,
            "conversation",
            "conversation objects are not supported: use previous_response_id",
        ),
        (body.prompt is not None, "prompt", "prompt templates are not supported: send input and instructions"),
    )
    if body.background and not body.store:
        raise ApiError(400, "background responses need store: true (they are read by GET)", param="background")
    if body.background and body.stream:
        raise ApiError(400, "background responses are not streamed: poll GET /v1/responses/{id}", param="stream")
    for refused, param, message in refusals:
        if refused:
            raise ApiError(400, message, param=param)
    if body.input is None and body.previous_response_id is None:
        raise ApiError(400, "input is required", param="input")
    _check_metadata(body.metadata or {})


# OpenAI's limits on metadata
_METADATA_PAIRS, _METADATA_KEY_CHARS, _METADATA_VALUE_CHARS = 16, 64, 512


def _check_metadata(metadata: dict[str, str]) -> None:
    if len(metadata) > _METADATA_PAIRS:
        raise ApiError(400, f"metadata holds at most {_METADATA_PAIRS} pairs, got {len(metadata)}", param="metadata")
    for key, value in metadata.items():
        if len(key) > _METADATA_KEY_CHARS or len(value) > _METADATA_VALUE_CHARS:
            raise ApiError(
                400,
                f"metadata {key[:_METADATA_KEY_CHARS]!r}: keys are at most {_METADATA_KEY_CHARS} characters, values "
                f"at most {_METADATA_VALUE_CHARS}",
                param="metadata",
            )


def _item_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of text parts", param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ApiError(
                400, f"{where}[{j}]: only input_text / output_text parts are supported, got {kind!r}", param="input"
            )
        unknown = sorted(set(part) - _PART_FIELDS)
        if unknown:
            raise ApiError(400, f"{where}[{j}]: unrecognized field {unknown[0]!r}", param="input")
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ApiError(400, f"{where}.{key} must be a string", param="input")
    return value


_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_items(value: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """`input` as a list of items (a string is one user message), each with an `id` (kept if given)."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    out = []
    for item in value:
        kind = item.get("type", "message" if "role" in item else "item")
        out.append({**item, "id": item.get("id") or item_id(_ID_PREFIXES.get(kind, "item"))})
    return out


def chat_messages_of_items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a conversation's items; a 400 naming the first item that is wrong."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        fields = _ITEM_FIELDS.get(kind) if isinstance(kind, str) else None
        if fields is None:
            raise ApiError(
                400,
                f"{where}.type {kind!r} is not supported (message, function_call, function_call_output, reasoning)",
                param="input",
            )
        unknown = sorted(set(item) - fields)
        if unknown:
            raise ApiError(400, f"{where}: unrecognized field {unknown[0]!r}", param="input")
        if kind == "message":
            role = _MESSAGE_ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise ApiError(
                    400, f"{where}.role must be user, system, developer or assistant, got {item.get('role')!r}",
                    param="input",
                )  # fmt: skip
            messages.append({"role": role, "content": _item_text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # parallel calls: one assistant turn
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _item_text(item.get("output"), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": output})
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Flat Responses function tools as chat tools; a built-in tool is a 400 naming it."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise ApiError(
                400, f"tools[{i}].type {kind!r} is not supported: only function tools (built-in tools run at OpenAI)",
                param="tools",
            )  # fmt: skip
        unknown = sorted(set(tool) - _FUNCTION_TOOL_FIELDS)
        if unknown:
            raise ApiError(400, f"tools[{i}]: unrecognized field {unknown[0]!r}", param="tools")
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """`tool_choice` in chat's shape (`{"type": "function", "name": ...}` -> chat's named form)."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or set(choice) != {"type", "name"}:
        raise ApiError(
            400,
            f'tool_choice must be "none", "auto", "required" or {{"type": "function", "name": ...}}, got {choice!r}',
            param="tool_choice",
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def response_format_of(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (None: plain text)."""
    if text is None:
        return None
    unknown = sorted(set(text) - {"format", "verbosity"})  # verbosity: accepted without effect
    if unknown:
        raise ApiError(400, f"text: unrecognized field {unknown[0]!r}", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ApiError(400, "text.format.schema must be a JSON schema object", param="text")
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise ApiError(400, f"text.format.type must be text, json_object or json_schema, got {kind!r}", param="text")


def chat_body_of(body: ResponsesBody, messages: list[dict[str, Any]]) -> ChatBody:
    """The chat request that generates this response's output."""
    if body.instructions:
        messages = [{"role": "system", "content": body.instructions}, *messages]
    if not messages:
        raise ApiError(400, "input must hold at least one message", param="input")
    return ChatBody(
        messages=messages,
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        logit_bias=body.logit_bias,
        tools=chat_tools(body.tools),
        tool_choice=chat_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=response_format_of(body.text),
        stream=body.stream,
    )
