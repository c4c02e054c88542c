"""The HTTP body parse never builds a grammar (a build can take seconds: turn 3 saw /health stall
2.4 s on one); the build runs in the front door's grammar thread, and its error still names the
request's field."""

from __future__ import annotations

import asyncio
import json

import llguidance
import pytest

from himamba.common.types import GrammarSpec
from himamba.services.tokenizer.http.errors import ApiError
from himamba.services.tokenizer.http.structured_outputs import (
    StructuredOutputFields,
    check_constraint,
    grammar_field,
    grammar_of,
)


def test_parsing_a_body_builds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_build(*_args, **_kwargs):
        raise AssertionError("a grammar was built while parsing the body")

    monkeypatch.setattr(llguidance.LLMatcher, "validate_grammar_with_warnings", no_build)
    monkeypatch.setattr(llguidance, "LLMatcher", no_build)
    body = StructuredOutputFields(
        response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}
    )
    assert grammar_of(body) == GrammarSpec(
        kind="json_schema", spec=json.dumps({"type": "object"}, separators=(",", ":"))
    )
    assert grammar_field(body) == "response_format.json_schema.schema"


def test_a_grammar_that_does_not_build_is_a_400_naming_its_field() -> None:
    async def check(spec: GrammarSpec) -> None:
        raise ValueError("grammar: unclosed group")

    body = StructuredOutputFields(guided_regex="a(b")
    spec = grammar_of(body)
    with pytest.raises(ApiError) as e:
        asyncio.run(check_constraint(spec, lambda: grammar_field(body), check))
    assert e.value.status == 400 and e.value.param == "guided_regex"
    assert "guided_regex: unclosed group" in str(e.value.message)
