"""/v1/responses with the official `openai` client against a real `himamba serve` (random-weight
NemotronH, the session's shared server): tool calls and structured outputs enforced by grammar,
a conversation continued by `previous_response_id` served from the prefix cache, streaming."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest

from tests.http.test_tools_live import WEATHER as CHAT_WEATHER

# chat's tool (bounded, so that a random-weight model must finish), in the Responses API's flat shape
WEATHER = {"type": "function", **CHAT_WEATHER["function"]}
# Bounded so that a random-weight model must finish: enums, no free-length numbers or strings.
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}, "score": {"type": "integer", "enum": [1, 2]}},
    "required": ["answer", "score"],
    "additionalProperties": False,
}
LONG_INPUT = "".join(f"def function_{i}(x):\n    return x * {i}\n\n" for i in range(12)) + "# What do these do?"


@pytest.fixture(scope="module")
def client(live_server: Any) -> Iterator[openai.OpenAI]:
    base = live_server.base_url + "/v1"
    with openai.OpenAI(base_url=base, api_key=live_server.api_key, max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    (card,) = client.models.list().data
    return card.id


def test_plain_response(client: openai.OpenAI, model: str):
    out = client.responses.create(model=model, input="Say hello", max_output_tokens=6, temperature=0)
    assert out.status in ("completed", "incomplete") and out.output[0].type == "message"
    assert isinstance(out.output_text, str)
    assert out.usage is not None and 1 <= out.usage.output_tokens <= 6 and out.usage.input_tokens > 0


def test_required_tool_call_validates_and_its_output_continues_it(client: openai.OpenAI, model: str):
    first = client.responses.create(
        model=model, input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_output_tokens=60,
    )  # fmt: skip
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    second = client.responses.create(
        model=model, previous_response_id=first.id, tools=[WEATHER], temperature=0, max_output_tokens=4,
        tool_choice="none", input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )  # fmt: skip
    assert second.output[0].type == "message" and second.previous_response_id == first.id


def test_text_format_json_schema_validates(client: openai.OpenAI, model: str):
    out = client.responses.create(
        model=model, input="Answer in JSON", temperature=0, max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "Answer", "schema": ANSWER, "strict": True}},
    )  # fmt: skip
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), ANSWER)


def test_second_turn_is_served_from_the_prefix_cache(client: openai.OpenAI, model: str, live_server: Any):
    first = client.responses.create(model=model, input=LONG_INPUT, max_output_tokens=8, temperature=0)
    second = client.responses.create(
        model=model, input="And briefly?", previous_response_id=first.id, max_output_tokens=8, temperature=0
    )
    assert first.usage is not None and second.usage is not None
    context = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens > context
    cached = second.usage.input_tokens_details.cached_tokens
    # the whole first turn (prompt and output) less the cache's page granularity
    assert cached >= context - 16, (cached, first.usage)
    by_tier = (second.usage.input_tokens_details.model_extra or {})["cached_tokens_by_tier"]
    assert sum(by_tier.values()) == cached
    # the continuation extends the first turn's token ids (its prompt, its greedy output) by the
    # template's end of turn and the new user turn (the demo checkpoint's template: "<|role|>\n...
    # <|endoftext|>\n"); its greedy tokens are those of /v1/completions on those same ids
    first_prompt = live_server.post_json(
        "/tokenize", {"model": model, "messages": [{"role": "user", "content": LONG_INPUT}]}
    )["tokens"]
    again = {"model": model, "prompt": first_prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    first_output = live_server.post_json("/v1/completions", again)["choices"][0]["token_ids"]
    assert len(first_output) == first.usage.output_tokens
    closing = "<|endoftext|>\n" if first.status == "incomplete" else "\n"  # EOS ends a completed turn
    tail = closing + "<|user|>\nAnd briefly?<|endoftext|>\n<|assistant|>\n"
    tail_ids = live_server.post_json("/tokenize", {"model": model, "prompt": tail, "add_special_tokens": False})[
        "tokens"
    ]
    ids = [*first_prompt, *first_output, *tail_ids]
    assert len(ids) == second.usage.input_tokens
    plain = live_server.post_json("/v1/completions", {"model": model, "prompt": ids, "max_tokens": 8, "temperature": 0})
    assert plain["choices"][0]["text"] == second.output_text


def test_stream_helper_agrees_with_the_stored_response(client: openai.OpenAI, model: str):
    with client.responses.stream(
        model=model, input="Pick one", temperature=0, max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "Answer", "schema": ANSWER, "strict": True}},
    ) as stream:  # fmt: skip
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text
    jsonschema.validate(json.loads(final.output_text), ANSWER)
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_background_response_completes(client: openai.OpenAI, model: str):
    out = client.responses.create(model=model, input="Say hello", max_output_tokens=4, temperature=0, background=True)
    assert out.status == "queued"
    for _ in range(1000):
        done = client.responses.retrieve(out.id)
        if done.status not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    assert done.status == "incomplete" and done.usage is not None and done.usage.output_tokens == 4


class Verdict(pydantic.BaseModel):
    answer: Literal["yes", "no"]
    score: Literal[1, 2]


def test_parse_with_a_pydantic_text_format(client: openai.OpenAI, model: str):
    out = client.responses.parse(
        model=model, input="Yes or no?", text_format=Verdict, temperature=0, max_output_tokens=60
    )
    assert isinstance(out.output_parsed, Verdict)
