"""Structured outputs with the official `openai` client against a real `himamba serve`
(random-weight NemotronH): every field style, schema-valid JSON that ends with "stop", regex and
choice outputs that match, streaming, n > 1, and the 400s for what cannot be built."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

S = {"type": "string", "maxLength": 8}
# Bounded so that even random weights must finish: short strings, few items, enums, bounded
# integers, and no free whitespace in the grammar.
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"a": S}, "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["n"],
     "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "maxItems": 3}}, "required": ["tags"],
     "additionalProperties": False},
    {"type": "object", "properties": {"x": {"type": "null"}, "y": {"const": "fixed"}}, "required": ["x", "y"],
     "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": -5, "maximum": 5}, "name": S},
     "required": ["id", "name"], "additionalProperties": False},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {"v": {"type": "boolean"}},
                                                "required": ["v"], "additionalProperties": False}},
     "required": ["inner"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
    {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 5},
    {"enum": ["alpha", "beta", 3, True, None]},
    {"type": "string", "maxLength": 12},
    {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "boolean"}, {"enum": ["u", "w"]}]}}, "required": ["v"],
     "additionalProperties": False},
    {"type": "object", "properties": {"p": {"type": "array", "items": {"type": "object", "properties": {"q": S},
                                                                        "required": ["q"],
                                                                        "additionalProperties": False},
                                            "maxItems": 2}},
     "required": ["p"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": [1, 2, 3]}, "c": S, "d": {"type": "null"}},
     "required": ["a", "b", "c", "d"], "additionalProperties": False},
    {"type": "object", "properties": {"opt": S, "req": {"type": "boolean"}}, "required": ["req"],
     "additionalProperties": False},
    {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4}}, "required": ["s"],
     "additionalProperties": False},
    {"type": "object", "properties": {"m": {"type": "array", "items": {"type": "array", "items": {"type": "boolean"},
                                                                        "maxItems": 2},
                                            "maxItems": 2}},
     "required": ["m"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": S, "role": {"enum": ["admin", "guest"]}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "role", "age"], "additionalProperties": False}},
     "required": ["user"], "additionalProperties": False},
]  # fmt: skip
MAX_TOKENS = 300  # far more than any of them can take
STYLES = ("response_format", "structured_outputs", "guided_json", "sglang_json_schema")


@pytest.fixture(scope="module")
def client(live_server: Any) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=live_server.base_url + "/v1", api_key=live_server.api_key, max_retries=0,
                       timeout=120) as c:  # fmt: skip
        yield c


@pytest.fixture(scope="module")
def model(demo_checkpoint: Path) -> str:
    return demo_checkpoint.name


def _ask(client: openai.OpenAI, model: str, schema: dict[str, Any], style: str, **kw: Any) -> Any:
    """One request constraining the output to `schema`, in one of the four field styles."""
    if style == "response_format":
        rf = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Answer in JSON."}], max_tokens=MAX_TOKENS,
            response_format=rf, **kw,
        )  # fmt: skip
    extra = {
        "structured_outputs": {"structured_outputs": {"json": schema}},
        "guided_json": {"guided_json": schema},
        "sglang_json_schema": {"json_schema": json.dumps(schema)},  # sglang sends the schema as text
    }[style]
    if style == "guided_json":
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "JSON please"}], max_tokens=MAX_TOKENS,
            extra_body=extra, **kw,
        )  # fmt: skip
    return client.completions.create(model=model, prompt="data = ", max_tokens=MAX_TOKENS, extra_body=extra, **kw)


def _text(choice: Any) -> str:
    return choice.message.content if hasattr(choice, "message") else choice.text


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_every_json_schema_output_validates_and_stops(client, model, i):
    schema = SCHEMAS[i]
    style = STYLES[i % len(STYLES)]
    # Greedy for half of them, seeded sampling for the others (different paths through the grammar).
    kw: dict[str, Any] = {"temperature": 0} if i % 2 == 0 else {"temperature": 1.0, "seed": i}
    out = _ask(client, model, schema, style, **kw)
    (choice,) = out.choices
    text = _text(choice)
    jsonschema.validate(json.loads(text), schema)
    assert choice.finish_reason == "stop", (style, text)


def test_response_format_works_on_completions_too(client, model):
    schema = SCHEMAS[3]
    out = client.completions.create(
        model=model, prompt="color = ", max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}},
    )  # fmt: skip
    jsonschema.validate(json.loads(out.choices[0].text), schema)
    assert out.choices[0].finish_reason == "stop"


def test_json_object_output_is_a_json_object_prefix_or_object(client, model):
    # {"type": "object"} is unbounded, so a random model may run out of tokens; what it wrote is
    # the start of a JSON object with no free whitespace, and a finished one parses.
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "JSON"}], max_tokens=40, temperature=0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    choice = out.choices[0]
    assert choice.message.content.startswith("{")
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)


REGEXES = [r"[a-c]{3}-[0-9]{2}", r"(yes|no|maybe)", r"[0-9]{1,4}(\.[0-9]{1,2})?", r"[A-Z][a-z]{0,6} [A-Z][a-z]{0,6}"]


@pytest.mark.parametrize("field", ["regex", "guided_regex", "structured_outputs"])
def test_regex_outputs_match(client, model, field):
    for k, pattern in enumerate(REGEXES):
        extra = {"structured_outputs": {"regex": pattern}} if field == "structured_outputs" else {field: pattern}
        out = client.completions.create(
            model=model, prompt="x", max_tokens=40, temperature=1.0, seed=k, extra_body=extra
        )
        (choice,) = out.choices
        assert re.fullmatch(pattern, choice.text), (pattern, choice.text)
        assert choice.finish_reason == "stop"


@pytest.mark.parametrize("field", ["guided_choice", "structured_outputs"])
def test_choice_outputs_are_one_of_the_choices(client, model, field):
    choices = ["positive", "negative", "neutral ☺"]
    for seed in range(3):
        extra = {"structured_outputs": {"choice": choices}} if field == "structured_outputs" else {field: choices}
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Sentiment?"}], max_tokens=20, temperature=1.0,
            seed=seed, extra_body=extra,
        )  # fmt: skip
        assert out.choices[0].message.content in choices
        assert out.choices[0].finish_reason == "stop"


def test_ebnf_grammar_output_matches(client, model):
    grammar = 'root ::= "(" digits ("+" digits)* ")"\ndigits ::= [0-9] | [0-9] [0-9]'
    for seed in range(3):
        out = client.completions.create(
            model=model, prompt="sum: ", max_tokens=40, temperature=1.0, seed=seed, extra_body={"ebnf": grammar}
        )
        text = out.choices[0].text
        if out.choices[0].finish_reason == "stop":
            assert re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})*\)", text), text
        else:  # "+digits" may repeat past the budget: what came is still a prefix of the language
            assert re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{0,2})*", text), text


def test_streamed_output_equals_its_non_streamed_twin_and_validates(client, model):
    schema = SCHEMAS[19]
    rf = {"type": "json_schema", "json_schema": {"name": "user", "schema": schema}}
    kw: dict[str, Any] = {
        "model": model, "messages": [{"role": "user", "content": "a user"}], "max_tokens": MAX_TOKENS,
        "temperature": 1.0, "seed": 7, "response_format": rf,
    }  # fmt: skip
    whole = client.chat.completions.create(**kw)
    text, reasons = "", []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            reasons.append(c.finish_reason)
    assert text == whole.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)
    assert reasons[-1] == "stop"


def test_n_samples_each_follow_the_grammar(client, model):
    schema = SCHEMAS[15]
    out = client.completions.create(
        model=model, prompt="row: ", max_tokens=MAX_TOKENS, temperature=1.0, seed=3, n=4,
        extra_body={"guided_json": schema},
    )  # fmt: skip
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    texts = [c.text for c in out.choices]
    for c in out.choices:
        jsonschema.validate(json.loads(c.text), schema)
        assert c.finish_reason == "stop"
    assert len(set(texts)) > 1  # each sample has its own matcher and its own draws


def test_streamed_n_samples_each_follow_the_grammar(client, model):
    pattern = r"[a-z]{2,6}"
    texts = {i: "" for i in range(3)}
    reasons: dict[int, str] = {}
    stream = client.completions.create(
        model=model, prompt="w", max_tokens=30, temperature=1.0, seed=5, n=3, stream=True,
        extra_body={"guided_regex": pattern},
    )  # fmt: skip
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert all(re.fullmatch(pattern, t) for t in texts.values()), texts
    assert reasons == {0: "stop", 1: "stop", 2: "stop"}


def test_a_repeated_prompt_hits_the_prefix_cache_and_still_follows_the_grammar(client, model):
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    schema = SCHEMAS[3]
    outs = [
        client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"guided_json": schema}
        )
        for _ in range(2)
    ]
    details = outs[1].usage.prompt_tokens_details
    assert details is not None and details.cached_tokens and details.cached_tokens > 0
    assert outs[0].choices[0].text == outs[1].choices[0].text
    jsonschema.validate(json.loads(outs[1].choices[0].text), schema)


def test_unconstrained_requests_beside_constrained_ones_are_unchanged(client, model):
    # Greedy text without a grammar is the same whether or not constrained requests ran.
    kw: dict[str, Any] = {"model": model, "prompt": "def main():", "max_tokens": 12, "temperature": 0}
    before = client.completions.create(**kw).choices[0].text
    client.completions.create(model=model, prompt="x", max_tokens=20, extra_body={"guided_regex": "[0-9]{3}"})
    assert client.completions.create(**kw).choices[0].text == before


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ("chat", {"response_format": {"type": "yaml"}}, "response_format"),
    ("completion", {"guided_regex": "a(b"}, "guided_regex"),
    ("completion", {"regex": "[z-a]"}, "regex"),
    ("completion", {"guided_choice": []}, "guided_choice"),
    ("completion", {"guided_choice": "yes"}, "guided_choice"),
    ("completion", {"guided_grammar": "root ::= missing_rule"}, "guided_grammar"),
    ("chat", {"ebnf": "this is not a grammar"}, "ebnf"),
    ("completion", {"json_schema": "{not json"}, "json_schema"),
    ("completion", {"guided_json": {"type": "string", "format": "no-such-format"}}, "guided_json"),
    ("completion", {"structured_outputs": {"regex": "("}}, "structured_outputs"),
    ("completion", {"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ("completion", {"guided_regex": "[0-9]+", "guided_choice": ["a"]}, "guided_choice"),
    ("completion", {"guided_regex": "[0-9]+", "ignore_eos": True}, "ignore_eos"),
]  # fmt: skip


@pytest.mark.parametrize("route,extra,param", BAD, ids=[f"{p}-{i}" for i, (_, _, p) in enumerate(BAD)])
def test_what_cannot_be_built_is_a_400_naming_the_field(client, model, route, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        if route == "chat":
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5, extra_body=extra
            )
        else:
            client.completions.create(model=model, prompt="hi", max_tokens=5, extra_body=extra)
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == param, body
    assert param in body["message"]


def test_sglang_generate_takes_a_constraint_in_its_sampling_params(live_server):
    for sp, check in [
        ({"regex": "[a-c]{4}"}, lambda t: re.fullmatch("[a-c]{4}", t)),
        ({"json_schema": json.dumps(SCHEMAS[1])}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[1]) is None),
        ({"ebnf": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
    ]:
        out = live_server.post_json("/generate", {"text": "q:", "sampling_params": {"max_new_tokens": 40, **sp}})
        assert check(out["text"]), (sp, out["text"])
        assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_sglang_generate_refuses_a_bad_constraint_naming_it(live_server):
    from tests.http_request import http_request

    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {live_server.api_key}"}
    for sp, param in [({"regex": "a(b"}, "regex"), ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf")]:
        body = json.dumps({"text": "q:", "sampling_params": {"max_new_tokens": 4, **sp}}).encode()
        r = http_request(live_server.port, "POST", "/generate", body, headers)
        assert r.status == 400, r.body
        assert r.json()["error"]["param"] == param


def test_each_prompt_of_a_batch_follows_the_grammar(client, model):
    out = client.completions.create(
        model=model, prompt=["first:", "second:", "third:"], max_tokens=10, temperature=1.0, seed=1, n=2,
        extra_body={"guided_choice": ["up", "down"]},
    )  # fmt: skip
    assert sorted(c.index for c in out.choices) == list(range(6))
    assert all(c.text in ("up", "down") and c.finish_reason == "stop" for c in out.choices)
