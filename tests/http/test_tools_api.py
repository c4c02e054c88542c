"""Tool calls, reasoning and unknown fields on /v1/chat/completions and /v1/completions, against
a TokenizerService whose fake scheduler writes the model's answer we script (`replies`): the
answer's tokens really stream through the detokenizer, the parsers and the SSE writer."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from tokenizers import Tokenizer

from himamba.common.messages import AddRequest
from himamba.services.tokenizer.http.unknown_fields import ChatNoEffect, CompletionNoEffect
from tests.http_request import free_port, http_request
from tests.tokenizer.fakes import FakeScheduler, running_service, service_config, write_model_dir

Harness = Any  # tests/http/conftest.py's Harness

# A Qwen3-like template: tools in the system turn with the <tool_call> instruction, and thinking
# opened in the prompt unless enable_thinking is false.
TOOL_TEMPLATE = (
    "{% if tools %}<|system|>\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
    'Call a function as <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|endoftext|>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
NO_THINK = {"enable_thinking": False}
KEY = "sk-tools"
CALL_TEXT = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
THINK_TEXT = "The user says hi: greet back.\n</think>\n\nHello there!"


class ToolHarness:
    def __init__(self, port: int, scheduler: FakeScheduler, tokenizer: Tokenizer):
        self.port = port
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        scheduler.replies.update({"call-weather": CALL_TEXT, "say-hi": THINK_TEXT})

    def post(self, path: str, body: dict[str, Any]) -> Any:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
        return http_request(self.port, "POST", path, json.dumps(body).encode(), headers)

    def stream(self, body: dict[str, Any]) -> list[Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request(
            "POST", "/v1/chat/completions", json.dumps({**body, "stream": True}), {"Authorization": f"Bearer {KEY}"}
        )
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        events = []
        for raw in resp.read().decode().split("\n\n"):
            if raw.strip():
                payload = raw.removeprefix("data: ")
                events.append(payload if payload == "[DONE]" else json.loads(payload))
        conn.close()
        assert events[-1] == "[DONE]"
        return events[:-1]

    def prompt_of(self, marker: str) -> str:
        add = self.scheduler.wait_for(
            lambda m: (
                isinstance(m, AddRequest) and marker in self.tokenizer.decode(m.input_ids, skip_special_tokens=False)
            )
        )
        return self.tokenizer.decode(add.input_ids, skip_special_tokens=False)


@pytest.fixture(scope="module")
def tools_harness(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer: Tokenizer) -> Iterator[ToolHarness]:
    tok_cfg = {"eos_token": "<|endoftext|>", "chat_template": TOOL_TEMPLATE}
    model_dir = write_model_dir(tmp_path_factory.mktemp("tools-model"), demo_tokenizer, tok_cfg)
    cfg = service_config(
        model_dir,
        512,
        http={"port": free_port(), "api_key": KEY, "tool_call_parser": "auto", "reasoning_parser": "qwen3"},
    )
    scheduler = FakeScheduler(cfg, demo_tokenizer, "plain answer", cfg_cached())
    try:
        with running_service(cfg):
            yield ToolHarness(cfg.http.port, scheduler, demo_tokenizer)
    finally:
        scheduler.close()


def cfg_cached() -> Any:
    from himamba.common.types import CachedTokens

    return CachedTokens()


def _chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 200, **extra}


# ---------------------------------------------------------------- tool_choice auto, end to end


def test_auto_tool_call_whole_answer(tools_harness: ToolHarness):
    r = tools_harness.post(
        "/v1/chat/completions", _chat("call-weather 1", tools=[WEATHER], chat_template_kwargs=NO_THINK)
    )
    assert r.status == 200, r.body
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] == "Checking." and msg["reasoning_content"] is None
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Zürich"}
    # the template saw the tools and enable_thinking
    prompt = tools_harness.prompt_of("call-weather 1")
    assert '"name": "get_weather"' in prompt and prompt.endswith("<think>\n\n</think>\n\n")


def test_auto_tool_call_streamed_token_by_token(tools_harness: ToolHarness):
    events = tools_harness.stream(_chat("call-weather 2", tools=[WEATHER], chat_template_kwargs=NO_THINK))
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0]["role"] == "assistant"
    heads = [tc for d in deltas for tc in d.get("tool_calls", []) if "id" in tc]
    assert len(heads) == 1 and heads[0]["index"] == 0 and heads[0]["type"] == "function"
    assert heads[0]["function"] == {"name": "get_weather", "arguments": ""}
    fragments = [tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", []) if "id" not in tc]
    assert len(fragments) > 1  # the arguments arrive as they are generated
    assert json.loads("".join(fragments)) == {"city": "Zürich"}
    assert "".join(d.get("content") or "" for d in deltas) == "Checking."
    reasons = [e["choices"][0]["finish_reason"] for e in events]
    assert reasons[-1] == "tool_calls" and all(r is None for r in reasons[:-1])


def test_auto_tool_call_with_the_openai_client(tools_harness: ToolHarness):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{tools_harness.port}/v1", api_key=KEY, max_retries=0)
    with client:
        model = client.models.list().data[0].id
        out = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "call-weather 3"}],
            tools=[WEATHER],
            tool_choice="auto",
            max_tokens=200,
            extra_body={"chat_template_kwargs": NO_THINK},
        )
        call = out.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Zürich"}
        args, names, ids = "", [], []
        for chunk in client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "call-weather 4"}],
            tools=[WEATHER],
            stream=True,
            max_tokens=200,
            extra_body={"chat_template_kwargs": NO_THINK},
        ):
            for tc in chunk.choices[0].delta.tool_calls or []:
                if tc.id:
                    ids.append(tc.id)
                    names.append(tc.function.name)
                args += tc.function.arguments or ""
        assert names == ["get_weather"] and len(ids) == 1 and json.loads(args) == {"city": "Zürich"}


def test_n_choices_each_parse_their_calls(tools_harness: ToolHarness):
    r = tools_harness.post(
        "/v1/chat/completions", _chat("call-weather 5", n=2, tools=[WEATHER], chat_template_kwargs=NO_THINK)
    )
    choices = r.json()["choices"]
    assert [c["finish_reason"] for c in choices] == ["tool_calls", "tool_calls"]
    ids = {c["message"]["tool_calls"][0]["id"] for c in choices}
    assert len(ids) == 2


def test_tool_choice_none_leaves_the_text_alone(tools_harness: ToolHarness):
    r = tools_harness.post(
        "/v1/chat/completions",
        _chat("call-weather 6", tools=[WEATHER], tool_choice="none", chat_template_kwargs=NO_THINK),
    )
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == CALL_TEXT


# ---------------------------------------------------------------- reasoning


def test_reasoning_is_split_out_whole_and_streamed(tools_harness: ToolHarness):
    r = tools_harness.post("/v1/chat/completions", _chat("say-hi 1"))
    msg = r.json()["choices"][0]["message"]
    assert msg["reasoning_content"] == "The user says hi: greet back.\n" and msg["content"] == "Hello there!"
    assert tools_harness.prompt_of("say-hi 1").endswith("<think>\n")  # the template opened it
    events = tools_harness.stream(_chat("say-hi 2"))
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == "Hello there!"
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


# ---------------------------------------------------------------- required / named (structured outputs)


def test_required_and_named_send_the_tool_schema_as_grammar(tools_harness: ToolHarness):
    """The grammar reaches the scheduler (the answer itself needs a model: tests/http/test_tools_live.py)."""
    tools_harness.scheduler.replies["need-call"] = '{"city": "Oslo"}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = tools_harness.post("/v1/chat/completions", _chat("need-call 1", tools=[WEATHER], tool_choice=named))
    assert r.status == 200, r.body
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "stop"  # OpenAI: a named function finishes with "stop"
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    add = tools_harness.scheduler.wait_for(
        lambda m: isinstance(m, AddRequest) and "need-call 1" in tools_harness.tokenizer.decode(m.input_ids)
    )
    assert add.sampling.grammar.kind == "json_schema"
    assert json.loads(add.sampling.grammar.spec) == WEATHER["function"]["parameters"]


def test_required_cut_by_max_tokens_returns_only_complete_calls(tools_harness: ToolHarness):
    """The engine stops mid-call (finish "length"): the answer keeps the calls that closed, each
    with valid JSON arguments, streamed or whole; the cut call is not returned."""
    two = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_weather", "parameters": {"city": "Ro'
    tools_harness.scheduler.replies["cut-calls"] = two + 'me"}}]'
    max_tokens = len(tools_harness.tokenizer.encode(two).ids)
    body = _chat("cut-calls 1", tools=[WEATHER], tool_choice="required") | {"max_tokens": max_tokens}
    (choice,) = tools_harness.post("/v1/chat/completions", body).json()["choices"]
    assert choice["finish_reason"] == "length"
    (call,) = choice["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    events = tools_harness.stream(
        _chat("cut-calls 2", tools=[WEATHER], tool_choice="required") | {"max_tokens": max_tokens}
    )
    calls = [tc for e in events for tc in e["choices"][0]["delta"].get("tool_calls", [])]
    assert {tc["index"] for tc in calls} == {0}
    assert json.loads("".join(tc["function"]["arguments"] for tc in calls)) == {"city": "Oslo"}
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    short = _chat("cut-calls 3", tools=[WEATHER], tool_choice="required") | {"max_tokens": 5}
    (choice,) = tools_harness.post("/v1/chat/completions", short).json()["choices"]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]


# ---------------------------------------------------------------- nothing silently ignored

CHAT_REFUSED = [
    ({"foo": 1}, "foo"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"verbosity": "low"}, "verbosity"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"service_tier": "cheapest"}, "service_tier"),
    ({"metadata": {"k": 1}}, "metadata"),
    ({"store": "yes"}, "store"),
    ({"stream_options": {"include_usage": True, "include_foo": True}}, "stream_options"),
    ({"no_stop_trim": True}, "no_stop_trim"),  # sglang's fields: only at the value that is what we do
    ({"skip_special_tokens": False}, "skip_special_tokens"),
    ({"separate_reasoning": False}, "separate_reasoning"),
    ({"return_hidden_states": True}, "return_hidden_states"),
    ({"tools": [WEATHER]}, "tool_choice"),  # tool_choice auto on a server without a parser
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}], "tool_choice": "none"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "color": "red"}}], "tool_choice": "none"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "none"}, "tools"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "none"}, "tools"),
    ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "strict": True}}]}, "tools"),  # strict under auto
]
COMPLETION_REFUSED = [
    ({"foo": 1}, "foo"),
    ({"metadata": {"k": "v"}}, "metadata"),  # a chat field, not a completions one
    ({"tools": [WEATHER]}, "tools"),
    ({"stream_options": {"bogus": 1}}, "stream_options"),
    ({"no_stop_trim": True}, "no_stop_trim"),
    ({"separate_reasoning": True}, "separate_reasoning"),  # a chat field
]
# Every field accepted without effect, with a value of its type: the test fails when the list changes.
CHAT_NO_EFFECT = {
    "user": "u-1",
    "safety_identifier": "s-1",
    "metadata": {"k": "v"},
    "store": True,
    "service_tier": "flex",
    "prompt_cache_key": "conv-7",
    "prompt_cache_retention": "24h",
    "modalities": ["text"],
    # sglang's, as sglang-router forwards them (at their defaults)
    "no_stop_trim": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}
COMPLETION_NO_EFFECT = {
    "user": "u-1",
    "no_stop_trim": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "return_hidden_states": False,
}


@pytest.mark.parametrize(("extra", "param"), CHAT_REFUSED, ids=lambda v: json.dumps(v)[:60])
def test_chat_fields_we_cannot_honour_are_400s_naming_them(harness: Harness, extra: dict[str, Any], param: str):
    r = harness.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **extra})
    assert r.status == 400, r.body
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and err["type"] == "invalid_request_error"


@pytest.mark.parametrize(("extra", "param"), COMPLETION_REFUSED, ids=lambda v: json.dumps(v)[:60])
def test_completion_fields_we_cannot_honour_are_400s_naming_them(harness: Harness, extra: dict[str, Any], param: str):
    r = harness.post("/v1/completions", {"prompt": "hi", **extra})
    assert r.status == 400, r.body
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"]


def test_unknown_field_message_is_openais():
    from himamba.services.tokenizer.http.bodies import ChatBody, decode_body
    from himamba.services.tokenizer.http.errors import ApiError

    with pytest.raises(ApiError) as e:
        decode_body(b'{"messages": [], "frobnicate": 1}', ChatBody)
    assert e.value.message == "Unrecognized request argument supplied: frobnicate"


@pytest.mark.parametrize("field", sorted(CHAT_NO_EFFECT))
def test_chat_fields_accepted_without_effect(harness: Harness, field: str):
    assert set(CHAT_NO_EFFECT) == set(ChatNoEffect.__struct_fields__)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: CHAT_NO_EFFECT[field]}
    r = harness.post("/v1/chat/completions", body)
    assert r.status == 200, r.body
    assert r.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("field", sorted(COMPLETION_NO_EFFECT))
def test_completion_fields_accepted_without_effect(harness: Harness, field: str):
    assert set(COMPLETION_NO_EFFECT) == set(CompletionNoEffect.__struct_fields__)
    r = harness.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, field: COMPLETION_NO_EFFECT[field]})
    assert r.status == 200, r.body


def test_tool_choice_none_and_obfuscation_are_accepted(harness: Harness):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "tools": [WEATHER],
        "tool_choice": "none",
        "parallel_tool_calls": False,
        "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False},
    }
    r = harness.post("/v1/chat/completions", body)
    assert r.status == 200, r.body


def test_the_http_api_page_lists_every_field_accepted_without_effect():
    page = (Path(__file__).resolve().parents[2] / "docs" / "api" / "http.md").read_text()
    for field in set(ChatNoEffect.__struct_fields__) | set(CompletionNoEffect.__struct_fields__):
        assert f"`{field}`" in page, field


# ---------------------------------------------------------------- a Mistral-style template, end to end

# Mistral's v3 template, abridged: calls replayed in a [TOOL_CALLS] list, and ids of 9 characters checked.
MISTRAL_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}[INST]{{ m['content'] }}[/INST]"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] %}[TOOL_CALLS] ["
    "{% for c in m['tool_calls'] %}{% if c['id'] | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] }}, "
    '"id": "{{ c[\'id\'] }}"}{% endfor %}]<|endoftext|>'
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}<|endoftext|>"
    "{% elif m['role'] == 'tool' %}[TOOL_RESULTS]{{ m['content'] }}[/TOOL_RESULTS]{% endif %}"
    "{% endfor %}"
)


@pytest.fixture(scope="module")
def mistral_harness(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer: Tokenizer) -> Iterator[ToolHarness]:
    tok_cfg = {"eos_token": "<|endoftext|>", "chat_template": MISTRAL_TEMPLATE}
    model_dir = write_model_dir(tmp_path_factory.mktemp("mistral-model"), demo_tokenizer, tok_cfg)
    cfg = service_config(model_dir, 512, http={"port": free_port(), "api_key": KEY, "tool_call_parser": "auto"})
    scheduler = FakeScheduler(cfg, demo_tokenizer, "plain answer", cfg_cached())
    try:
        with running_service(cfg):
            yield ToolHarness(cfg.http.port, scheduler, demo_tokenizer)
    finally:
        scheduler.close()


def test_mistral_calls_are_read_and_their_ids_replay_in_its_template(mistral_harness: ToolHarness):
    """auto picks `mistral` from the template; the call's id (9 letters or digits) is one the
    template accepts when the conversation comes back with the tool's result."""
    mistral_harness.scheduler.replies["paris-weather"] = 'On it.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    r = mistral_harness.post("/v1/chat/completions", _chat("paris-weather 1", tools=[WEATHER]))
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "On it."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert len(call["id"]) == 9 and call["id"].isalnum()
    events = mistral_harness.stream(_chat("paris-weather 2", tools=[WEATHER]))
    calls = [tc for e in events for tc in e["choices"][0]["delta"].get("tool_calls", [])]
    assert "".join(tc["function"]["arguments"] for tc in calls) == '{"city": "Paris"}'
    follow = [
        {"role": "user", "content": "paris-weather 3"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
    ]
    r = mistral_harness.post("/v1/chat/completions", {"messages": follow, "tools": [WEATHER], "max_tokens": 5})
    assert r.status == 200, r.body
    assert f'"id": "{call["id"]}"' in mistral_harness.prompt_of("[TOOL_RESULTS]sunny")
