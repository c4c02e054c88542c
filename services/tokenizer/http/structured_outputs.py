"""Structured-output request fields -> one `GrammarSpec`, checked before the request is queued.

Accepted, on /v1/completions and /v1/chat/completions alike:
- OpenAI: `response_format` `{"type": "json_object"}` / `{"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}}` (`text` means no constraint; on completions too, as vLLM);
- vLLM: `structured_outputs` `{json | regex | choice | grammar | json_object}` and the older
  `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`;
- sglang: `json_schema`, `regex`, `ebnf` (and in /generate's `sampling_params`).

At most one constraint per request. A malformed one is a 400 naming its field here; whether it
builds is checked by the front door (in a thread: a build can take seconds), through
`check_constraint`, which names the field too.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from himamba.common.types import GrammarKind, GrammarSpec
from himamba.services.tokenizer.http.errors import ApiError

GrammarCheck = Callable[[GrammarSpec], Awaitable[None]]


class StructuredOutputFields(msgspec.Struct, frozen=True, kw_only=True):
    """The request fields that constrain the output (a base of both request bodies)."""

    response_format: dict[str, Any] | None = None  # OpenAI (vLLM takes it on completions too)
    structured_outputs: dict[str, Any] | None = None  # vLLM
    guided_json: dict[str, Any] | str | None = None  # vLLM (older)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    json_schema: dict[str, Any] | str | None = None  # sglang
    regex: str | None = None
    ebnf: str | None = None


_STRUCTURED_OUTPUTS_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "ebnf"}


def _schema_text(value: Any, field: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, bool)):
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    raise ApiError(400, f"{field} must be a JSON schema (an object or its JSON text)", param=_param(field))


def _param(field: str) -> str:
    return field.split(".", 1)[0].split("[", 1)[0]


def _response_format(rf: dict[str, Any]) -> tuple[str, GrammarSpec] | None:
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", GrammarSpec(kind="json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise ApiError(400, "response_format.json_schema must be an object", param="response_format")
        if "schema" not in js:
            raise ApiError(400, "response_format.json_schema.schema is required", param="response_format")
        field = "response_format.json_schema.schema"
        return field, GrammarSpec(kind="json_schema", spec=_schema_text(js["schema"], field))
    raise ApiError(
        400,
        f"response_format type {kind!r} is not supported (text, json_object or json_schema)",
        param="response_format",
    )


def _structured_outputs(so: dict[str, Any]) -> list[tuple[str, GrammarSpec]]:
    found: list[tuple[str, GrammarSpec]] = []
    for key, value in so.items():
        field = f"structured_outputs.{key}"
        if value is None or value is False:
            continue
        if key == "json_object" and value is True:
            found.append((field, GrammarSpec(kind="json_object")))
            continue
        kind = _STRUCTURED_OUTPUTS_KEYS.get(key)
        if kind is None:
            raise ApiError(
                400,
                f"{field} is not supported (json, regex, choice, grammar or json_object)",
                param="structured_outputs",
            )
        found.append((field, _spec(kind, value, field)))  # type: ignore[arg-type]
    return found


def _spec(kind: GrammarKind, value: Any, field: str) -> GrammarSpec:
    if kind == "json_schema":
        return GrammarSpec(kind=kind, spec=_schema_text(value, field))
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ApiError(400, f"{field} must be a list of strings", param=_param(field))
        return GrammarSpec(kind=kind, spec=json.dumps(value, ensure_ascii=False))
    if not isinstance(value, str):
        raise ApiError(400, f"{field} must be a string", param=_param(field))
    return GrammarSpec(kind=kind, spec=value)


def grammar_of(body: StructuredOutputFields) -> GrammarSpec | None:
    """The one constraint a body asks for (None: unconstrained); ApiError 400 naming the field
    when there are several, or the one given is malformed."""
    got = _one(_found(body))
    return got[1] if got is not None else None


def grammar_field(body: StructuredOutputFields) -> str:
    """The field `grammar_of(body)` came from (for messages)."""
    got = _one(_found(body))
    return got[0] if got is not None else "structured_outputs"


def _found(body: StructuredOutputFields) -> list[tuple[str, GrammarSpec]]:
    found: list[tuple[str, GrammarSpec]] = []
    if body.response_format is not None:
        got = _response_format(body.response_format)
        if got is not None:
            found.append(got)
    if body.structured_outputs is not None:
        found += _structured_outputs(body.structured_outputs)
    for field, kind in (
        ("guided_json", "json_schema"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "ebnf"),
        ("json_schema", "json_schema"),
        ("regex", "regex"),
        ("ebnf", "ebnf"),
    ):
        value = getattr(body, field)
        if value is not None:
            found.append((field, _spec(kind, value, field)))  # type: ignore[arg-type]
    return found


def _sglang_found(sampling_params: Any) -> list[tuple[str, GrammarSpec]]:
    found: list[tuple[str, GrammarSpec]] = []
    for name, kind in (("json_schema", "json_schema"), ("regex", "regex"), ("ebnf", "ebnf")):
        value = getattr(sampling_params, name)
        if value is not None:
            found.append((name, _spec(kind, value, name)))  # type: ignore[arg-type]
    return found


def sglang_sampling_grammar(sampling_params: Any) -> GrammarSpec | None:
    """The constraint of sglang's /generate `sampling_params` (`json_schema` as text, `regex`,
    `ebnf`); ApiError 400 naming the field as `grammar_of` does."""
    got = _one(_sglang_found(sampling_params))
    return got[1] if got is not None else None


def sglang_grammar_field(sampling_params: Any) -> str:
    """The field `sglang_sampling_grammar(sampling_params)` came from."""
    got = _one(_sglang_found(sampling_params))
    return got[0] if got is not None else "sampling_params"


def _one(found: list[tuple[str, GrammarSpec]]) -> tuple[str, GrammarSpec] | None:
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(f for f, _ in found)
        raise ApiError(
            400, f"only one structured-output constraint may be given, got {names}", param=_param(found[1][0])
        )
    return found[0]


async def check_constraint(spec: GrammarSpec | None, field: Callable[[], str], check: GrammarCheck) -> None:
    """ApiError 400 naming the field (`field()`) when `spec` does not build; the build runs off
    the event loop (`check`: the front door's, cached, so the request's own check is free)."""
    if spec is None:
        return
    try:
        await check(spec)
    except ValueError as e:
        name = field()
        why = str(e).removeprefix("grammar: ")
        raise ApiError(400, f"{name}: {why}", param=_param(name), code="invalid_grammar") from None
