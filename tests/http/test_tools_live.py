"""Tool calls end to end with the official `openai` client against a real `himamba serve`
(random-weight NemotronH) started with `--tool-call-parser hermes --reasoning-parser qwen3`.

`tool_choice` "required" and a named function are enforced by structured outputs, so even random
weights return calls whose arguments validate against the tool's parameters (jsonschema), streamed
and not. `tool_choice: "auto"` is driven by a grammar (sglang's `regex` field) that makes the model
write a `<tool_call>` block, which the hermes parser then reads.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.live_server import LiveServer, start_live_server

KEY = "sk-tools-live"
# Bounded so that a random-weight model must finish: enums, no free-length numbers or strings.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                "days": {"type": "integer", "enum": [1, 2, 3]},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "parameters": {
            "type": "object",
            "properties": {"hour": {"type": "integer", "enum": [6, 7]}, "label": {"type": "string", "maxLength": 5}},
            "required": ["hour"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tools_server(demo_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = start_live_server(
        demo_checkpoint,
        tmp_path_factory.mktemp("tools-logs"),
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
        api_key=KEY,
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(tools_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=tools_server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _check_calls(calls: list[Any], allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed_calls(stream: Any) -> tuple[list[dict[str, str]], str | None]:
    calls: list[dict[str, str]] = []
    reason = None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        reason = choice.finish_reason or reason
        for tc in choice.delta.tool_calls or []:
            if tc.id:
                assert tc.index == len(calls) and tc.type == "function" and tc.function.arguments == ""
                calls.append({"name": tc.function.name, "arguments": ""})
            else:
                calls[tc.index]["arguments"] += tc.function.arguments or ""
    return calls, reason


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_named_function_returns_valid_arguments(client: openai.OpenAI, model: str, seed: int):
    named = {"type": "function", "function": {"name": "set_alarm"}}
    out = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice=named, max_tokens=200, seed=seed, temperature=1.0
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI: a named function finishes with "stop"
    assert choice.message.content is None
    _check_calls(choice.message.tool_calls, {"set_alarm"})
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice=named, max_tokens=200, seed=seed, stream=True
    )
    calls, reason = _streamed_calls(stream)
    assert reason == "stop" and [c["name"] for c in calls] == ["set_alarm"]
    assert calls[0]["arguments"] == choice.message.tool_calls[0].function.arguments  # same seed, same answer
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS["set_alarm"])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_returns_valid_calls(client: openai.OpenAI, model: str, parallel: bool):
    out = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        max_tokens=300,
        seed=3,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls, {"get_weather", "set_alarm"})
    if not parallel:
        assert len(choice.message.tool_calls) == 1
    calls, reason = _streamed_calls(
        client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
            max_tokens=300,
            seed=3,
            stream=True,
        )
    )
    assert reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]


def test_auto_reads_the_call_a_grammar_made_the_model_write(client: openai.OpenAI, model: str):
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>'
    extra = {"regex": re.escape(text), "chat_template_kwargs": {"enable_thinking": False}}
    out = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=200, extra_body=extra
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome", "days": 2}
    calls, reason = _streamed_calls(
        client.chat.completions.create(
            model=model, messages=MESSAGES, tools=TOOLS, max_tokens=200, extra_body=extra, stream=True
        )
    )
    assert reason == "tool_calls"
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'}]


def test_reasoning_split_on_a_real_model(client: openai.OpenAI, model: str):
    text = "<think>plan</think>Done."
    out = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=100, extra_body={"regex": re.escape(text)}
    )
    msg = out.choices[0].message
    assert (msg.model_extra or {}).get("reasoning_content") == "plan" and msg.content == "Done."


def test_required_with_another_constraint_is_a_400(client: openai.OpenAI, model: str):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required", extra_body={"regex": "a+"}
        )
    assert "tool_choice" in str(e.value)
