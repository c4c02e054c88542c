"""POST /v1/responses (and GET / DELETE /v1/responses/{id}) with the official `openai` client,
against a TokenizerService whose fake scheduler writes the answers we script: the answer's tokens
really stream through the detokenizer, the chat parsers and the Responses writer.

The server reads tool calls as hermes (`<tool_call>` JSON) and splits `<think>` reasoning (qwen3).
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
from tokenizers import Tokenizer

from himamba.common.messages import AbortRequest, AddRequest
from himamba.common.types import CachedTokens
from tests.http.test_tools_api import WEATHER as CHAT_WEATHER
from tests.http_request import free_port, http_request
from tests.tokenizer.fakes import FakeScheduler, running_service, service_config, write_model_dir

# Tools in the system turn (with the <tool_call> instruction), one turn per message; tool calls
# of an assistant turn are written as <tool_call> blocks, so a replayed call is seen by the model.
TEMPLATE = (
    "{% if tools %}<|system|>\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|endoftext|>\n"
    "{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>{{ c['function']['name'] }} {{ c['function']['arguments'] }}"
    "</tool_call>{% endfor %}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
KEY = "sk-responses"
CACHED = CachedTokens(device=3, host=2, storage=1)
# chat's tool, in the Responses API's flat shape
WEATHER = {"type": "function", **CHAT_WEATHER["function"]}
CALL_TEXT = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
THINK_TEXT = "<think>The user says hi: greet back.</think>\n\nHello there!"
REPLIES = {"call-weather": CALL_TEXT, "say-hi": THINK_TEXT, "json-please": '{"answer": 42}', "short-one": "Done."}


class Harness:
    def __init__(self, port: int, scheduler: FakeScheduler, tokenizer: Tokenizer):
        self.port = port
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        scheduler.replies.update(REPLIES)
        scheduler.failing.append("engine-fails")
        scheduler.holding.append("never-ends")

    def request(self, method: str, path: str, body: Any = None) -> Any:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
        return http_request(self.port, method, path, None if body is None else json.dumps(body).encode(), headers)

    def add_request(self, marker: str) -> AddRequest:
        return self.scheduler.wait_for(
            lambda m: (
                isinstance(m, AddRequest) and marker in self.tokenizer.decode(m.input_ids, skip_special_tokens=False)
            )
        )

    def prompt_of(self, marker: str) -> str:
        return self.tokenizer.decode(self.add_request(marker).input_ids, skip_special_tokens=False)

    def sse(self, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """The (event name, data) pairs of a streamed response."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("POST", "/v1/responses", json.dumps({**body, "stream": True}), {"Authorization": f"Bearer {KEY}"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        events = []
        for raw in resp.read().decode().split("\n\n"):
            if raw.strip():
                name, data = raw.split("\n", 1)
                events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
        conn.close()
        return events


@contextmanager
def _serving(tmp: Path, tokenizer: Tokenizer, **http: Any) -> Iterator[Harness]:
    """A TokenizerService on TEMPLATE with a fake scheduler; `http` adds to its HTTP config."""
    model_dir = write_model_dir(tmp, tokenizer, {"eos_token": "<|endoftext|>", "chat_template": TEMPLATE})
    cfg = service_config(
        model_dir,
        1024,
        model={"served_model_name": "fake-model"},
        scheduler={"default_max_tokens": 200},
        http={"port": free_port(), "api_key": KEY, **http},
    )
    scheduler = FakeScheduler(cfg, tokenizer, "plain answer text", CACHED)
    try:
        with running_service(cfg):
            yield Harness(cfg.http.port, scheduler, tokenizer)
    finally:
        scheduler.close()


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer: Tokenizer) -> Iterator[Harness]:
    with _serving(
        tmp_path_factory.mktemp("responses-model"), demo_tokenizer, tool_call_parser="hermes", reasoning_parser="qwen3"
    ) as h:
        yield h


@pytest.fixture(scope="module")
def client(harness: Harness) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"http://127.0.0.1:{harness.port}/v1", api_key=KEY, max_retries=0, timeout=30) as c:
        yield c


# ---------------------------------------------------------------- step 1: create, non-streamed


def test_string_input_gives_a_message_and_usage(client: openai.OpenAI, harness: Harness):
    out = client.responses.create(model="fake-model", input="short-one please", instructions="Be terse.")
    assert out.id.startswith("resp_") and out.object == "response"
    assert out.status == "completed" and out.incomplete_details is None
    (item,) = out.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert [p.type for p in item.content] == ["output_text"]
    assert out.output_text == "Done."
    assert out.instructions == "Be terse." and out.model == "fake-model"
    usage = out.usage
    assert usage is not None and usage.output_tokens == len(harness.tokenizer.encode("Done.").ids)
    assert usage.input_tokens > 0 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == CACHED.total
    assert (usage.input_tokens_details.model_extra or {})["cached_tokens_by_tier"] == {
        "device": 3, "host": 2, "storage": 1,
    }  # fmt: skip
    assert usage.output_tokens_details.reasoning_tokens == 0
    # instructions are a leading system turn of the chat template
    assert harness.prompt_of("short-one please") == (
        "<|system|>\nBe terse.<|endoftext|>\n<|user|>\nshort-one please<|endoftext|>\n<|assistant|>\n"
    )


def test_cut_by_max_output_tokens_is_incomplete(client: openai.OpenAI, harness: Harness):
    out = client.responses.create(model="fake-model", input="anything", max_output_tokens=2, store=False)
    assert out.status == "incomplete"
    assert out.incomplete_details is not None and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage is not None and out.usage.output_tokens == 2
    assert out.output_text == harness.tokenizer.decode(harness.tokenizer.encode("plain answer text").ids[:2])


def test_message_items_roles_and_parts(client: openai.OpenAI, harness: Harness):
    client.responses.create(
        model="fake-model",
        input=[
            {"role": "developer", "content": "dev rules"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "part one"},
                                                            {"type": "input_text", "text": "part two"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "earlier answer"}]},
            {"role": "user", "content": "items-marker"},
        ],
        temperature=0.5,
        top_p=0.9,
        metadata={"k": "v"},
    )  # fmt: skip
    add = harness.add_request("items-marker")
    assert harness.tokenizer.decode(add.input_ids, skip_special_tokens=False) == (
        "<|system|>\ndev rules<|endoftext|>\n<|user|>\npart one\npart two<|endoftext|>\n"
        "<|assistant|>\nearlier answer<|endoftext|>\n<|user|>\nitems-marker<|endoftext|>\n<|assistant|>\n"
    )
    assert add.sampling.temperature == 0.5 and add.sampling.top_p == 0.9


def test_metadata_and_sampling_are_echoed(client: openai.OpenAI):
    out = client.responses.create(model="fake-model", input="short-one", temperature=0.25, metadata={"k": "v"})
    assert out.metadata == {"k": "v"} and out.temperature == 0.25 and out.top_p == 1.0


def test_function_call_and_output_items_continue_a_call(client: openai.OpenAI, harness: Harness):
    client.responses.create(
        model="fake-model",
        tools=[WEATHER],
        tool_choice="none",
        input=[
            {"role": "user", "content": "weather in Oslo?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 20C call-output-marker"},
        ],
    )
    prompt = harness.prompt_of("call-output-marker")
    assert prompt.endswith(
        '<|assistant|>\n<tool_call>get_weather {"city":"Oslo"}</tool_call><|endoftext|>\n'
        "<|tool|>\nsunny, 20C call-output-marker<|endoftext|>\n<|assistant|>\n"
    )
    assert '"name": "get_weather"' in prompt  # the tools reach the template in chat's shape


def test_auto_tool_call_becomes_a_function_call_item(client: openai.OpenAI):
    out = client.responses.create(model="fake-model", input="call-weather now", tools=[WEATHER])
    assert out.status == "completed"
    message, call = out.output
    assert message.type == "message" and out.output_text == "Checking."
    assert call.type == "function_call" and call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Zürich"}
    assert out.tool_choice == "auto" and out.tools[0].name == "get_weather"


def test_required_and_named_tool_choice_are_grammar_enforced(client: openai.OpenAI, harness: Harness):
    client.responses.create(model="fake-model", input="required-marker", tools=[WEATHER], tool_choice="required")
    grammar = harness.add_request("required-marker").sampling.grammar
    assert grammar is not None and grammar.kind == "json_schema"
    schema = json.loads(grammar.spec or "")
    assert schema["type"] == "array" and schema["items"]["properties"]["name"]["enum"] == ["get_weather"]
    client.responses.create(
        model="fake-model", input="named-marker", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
    )  # fmt: skip
    grammar = harness.add_request("named-marker").sampling.grammar
    assert grammar is not None and json.loads(grammar.spec or "") == WEATHER["parameters"]


def test_named_tool_choice_reads_the_answer_as_the_call(client: openai.OpenAI):
    out = client.responses.create(
        model="fake-model",
        input="json-please",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
    )
    (call,) = out.output
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {"answer": 42}


def test_text_format_json_schema_and_json_object(client: openai.OpenAI, harness: Harness):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    out = client.responses.create(
        model="fake-model", input="json-please schema",
        text={"format": {"type": "json_schema", "name": "Answer", "schema": schema, "strict": True}},
    )  # fmt: skip
    assert json.loads(out.output_text) == {"answer": 42}
    assert out.text is not None and out.text.format is not None and out.text.format.type == "json_schema"
    grammar = harness.add_request("json-please schema").sampling.grammar
    assert grammar is not None and grammar.kind == "json_schema" and json.loads(grammar.spec or "") == schema
    client.responses.create(model="fake-model", input="json-please object", text={"format": {"type": "json_object"}})
    grammar = harness.add_request("json-please object").sampling.grammar
    assert grammar is not None and grammar.kind == "json_object"


def test_reasoning_is_split_into_a_reasoning_item(client: openai.OpenAI, harness: Harness):
    out = client.responses.create(model="fake-model", input="say-hi")
    reasoning, message = out.output
    assert message.type == "message"
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert reasoning.content is not None and reasoning.content[0].text == "The user says hi: greet back."
    assert out.output_text == "Hello there!"
    expected = len(harness.tokenizer.encode("The user says hi: greet back.", add_special_tokens=False).ids)
    assert out.usage is not None and out.usage.output_tokens_details.reasoning_tokens == expected


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": "x", "frobnicate": 1}, "frobnicate", "Unrecognized request argument supplied: frobnicate"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "'web_search' is not supported"),
        ({"input": "x", "background": True, "store": False}, "background", "need store: true"),
        ({"input": "x", "background": True, "stream": True}, "stream", "not streamed"),
        ({"input": "x", "truncation": "auto"}, "truncation", "truncation"),
        ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include", "include is not supported"),
        ({"input": "x", "conversation": "conv_1"}, "conversation", "previous_response_id"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input", "input_image"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "'item_reference' is not supported"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input", "input[0].role must be"),
        ({"input": [{"role": "user", "content": "x", "extra": 1}]}, "input", "unrecognized field 'extra'"),
        ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text", "text.format.type"),
        ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice", "tool_choice"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({}, "input", "input is required"),
        ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16 pairs"),
        ({"input": "x", "metadata": {"k": "v" * 513}}, "metadata", "values at most 512"),
        ({"input": "x", "stream_options": {"include_usage": True}}, "stream_options", "include_usage"),
        ({"input": "x", "max_output_tokens": "many"}, "max_output_tokens", "Expected `int | null`"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(harness: Harness, body: dict[str, Any], param: str, words: str):
    r = harness.request("POST", "/v1/responses", {"model": "fake-model", **body})
    assert r.status == 400, r.body
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_no_effect_fields_are_accepted(client: openai.OpenAI):
    out = client.responses.create(
        model="fake-model", input="short-one", user="u1", safety_identifier="s", prompt_cache_key="k",
        service_tier="auto", reasoning={"effort": "low"}, text={"verbosity": "low"}, store=False,
    )  # fmt: skip
    assert out.output_text == "Done." and out.store is False


# ---------------------------------------------------------------- step 2: store, retrieve, continue


def test_store_retrieve_and_delete(client: openai.OpenAI):
    out = client.responses.create(model="fake-model", input="short-one stored")
    assert out.store is True
    again = client.responses.retrieve(out.id)
    assert again.id == out.id and again.output_text == "Done." and again.status == "completed"
    client.responses.delete(out.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(out.id)
    assert out.id in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(out.id)


def test_not_stored_is_not_found(client: openai.OpenAI):
    out = client.responses.create(model="fake-model", input="short-one", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(out.id)


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI, harness: Harness):
    first = client.responses.create(model="fake-model", input="turn-one short-one", instructions="first rules")
    second = client.responses.create(
        model="fake-model", input="turn-two short-one", previous_response_id=first.id, instructions="second rules"
    )
    assert second.previous_response_id == first.id
    # earlier input and output come first; instructions are not carried over (as OpenAI's)
    assert harness.prompt_of("turn-two") == (
        "<|system|>\nsecond rules<|endoftext|>\n<|user|>\nturn-one short-one<|endoftext|>\n"
        "<|assistant|>\nDone.<|endoftext|>\n<|user|>\nturn-two short-one<|endoftext|>\n<|assistant|>\n"
    )
    # a third turn continues the second, which holds the first
    client.responses.create(model="fake-model", input="turn-three", previous_response_id=second.id)
    assert harness.prompt_of("turn-three").startswith("<|user|>\nturn-one short-one<|endoftext|>\n<|assistant|>\nDone.")


def test_previous_tool_call_is_continued_by_its_output(client: openai.OpenAI, harness: Harness):
    first = client.responses.create(model="fake-model", input="call-weather please", tools=[WEATHER])
    call = first.output[-1]
    assert call.type == "function_call"
    client.responses.create(
        model="fake-model", previous_response_id=first.id, tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "rainy tool-result-marker"}],
    )  # fmt: skip
    # the stored turn token for token (the model's own tool-call text, not the template's rendering
    # of it), closed as the template closes an assistant turn, then the output as the next turn
    prompt = harness.prompt_of("tool-result-marker")
    assert prompt.endswith(
        "<|assistant|>\n"
        + CALL_TEXT
        + "<|endoftext|>\n<|tool|>\nrainy tool-result-marker<|endoftext|>\n<|assistant|>\n"
    )
    turn_one = harness.add_request("call-weather please")
    output_ids = harness.tokenizer.encode(CALL_TEXT).ids
    assert harness.add_request("tool-result-marker").input_ids[: len(turn_one.input_ids) + len(output_ids)] == [
        *turn_one.input_ids,
        *output_ids,
    ]


def test_input_items_list_the_whole_conversation(client: openai.OpenAI, harness: Harness):
    first = client.responses.create(model="fake-model", input="listed-one short-one")
    second = client.responses.create(
        model="fake-model", previous_response_id=first.id,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "listed-two"}]}],
    )  # fmt: skip
    items = list(client.responses.input_items.list(second.id, order="asc"))
    assert [i.type for i in items] == ["message", "message", "message"]
    assert [(i.role, i.content[0].type, i.content[0].text) for i in items] == [
        ("user", "input_text", "listed-one short-one"),
        ("assistant", "output_text", "Done."),
        ("user", "input_text", "listed-two"),
    ]
    assert items[1].id == first.output[0].id and all(i.id for i in items)
    newest = client.responses.input_items.list(second.id, limit=2)  # desc by default
    assert [i.id for i in newest.data] == [items[2].id, items[1].id] and newest.has_more
    rest = client.responses.input_items.list(second.id, limit=2, after=items[1].id)
    assert [i.id for i in rest.data] == [items[0].id] and not rest.has_more
    assert [i.id for i in client.responses.input_items.list(first.id)] == [items[0].id]


@pytest.mark.parametrize(
    ("query", "param"), [("limit=0", "limit"), ("order=up", "order"), ("after=nope", "after"), ("page=2", "page")]
)
def test_input_items_bad_queries(client: openai.OpenAI, harness: Harness, query: str, param: str):
    out = client.responses.create(model="fake-model", input="short-one queried")
    r = harness.request("GET", f"/v1/responses/{out.id}/input_items?{query}")
    assert r.status in (400, 404) and r.json()["error"]["param"] == param, r.body
    assert harness.request("GET", "/v1/responses/resp_nope/input_items").status == 404


def test_unknown_previous_response_id_is_404(harness: Harness):
    r = harness.request("POST", "/v1/responses", {"input": "x", "previous_response_id": "resp_nope"})
    assert r.status == 404
    err = r.json()["error"]
    assert err["param"] == "previous_response_id" and "resp_nope" in err["message"]
    r = harness.request("GET", "/v1/responses/resp_nope")
    assert r.status == 404 and "resp_nope" in r.json()["error"]["message"]


# ---------------------------------------------------------------- step 3: streaming


def _names(events: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [name for name, _ in events]


def test_streamed_text_event_sequence(harness: Harness):
    events = harness.sse({"input": "short-one streamed"})
    names = _names(events)
    assert [data["type"] for _, data in events] == names
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    deltas = [i for i, n in enumerate(names) if n == "response.output_text.delta"]
    assert names[: deltas[0]] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
    ]  # fmt: skip
    assert names[deltas[-1] + 1 :] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert len(deltas) > 1  # one per token: "Done." is several
    text = "".join(events[i][1]["delta"] for i in deltas)
    assert text == "Done." == events[deltas[-1] + 1][1]["text"]
    created, done = events[0][1]["response"], events[-1][1]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    assert done["id"] == created["id"] and done["status"] == "completed"
    assert done["output"][0]["content"][0]["text"] == "Done." and done["usage"]["output_tokens"] == len(deltas)


def test_streamed_function_call_events(harness: Harness):
    events = harness.sse({"input": "call-weather streamed", "tools": [WEATHER]})
    names = _names(events)
    assert names.count("response.output_item.added") == 2 == names.count("response.output_item.done")
    arg_deltas = [d["delta"] for n, d in events if n == "response.function_call_arguments.delta"]
    (args_done,) = [d for n, d in events if n == "response.function_call_arguments.done"]
    assert json.loads("".join(arg_deltas)) == {"city": "Zürich"} and "".join(arg_deltas) == args_done["arguments"]
    assert args_done["name"] == "get_weather" and args_done["output_index"] == 1
    added = [d["item"] for n, d in events if n == "response.output_item.added"]
    assert [i["type"] for i in added] == ["message", "function_call"] and added[1]["arguments"] == ""
    first_arg = names.index("response.function_call_arguments.delta")
    assert names.index("response.output_item.done") < names.index("response.output_item.added", 3) < first_arg
    assert names[-1] == "response.completed"


def test_streamed_reasoning_events(harness: Harness):
    events = harness.sse({"input": "say-hi streamed"})
    names = _names(events)
    reasoning = "".join(d["delta"] for n, d in events if n == "response.reasoning_text.delta")
    assert reasoning == "The user says hi: greet back."
    assert names.index("response.reasoning_text.done") < names.index("response.output_text.delta")


def test_client_stream_helper(client: openai.OpenAI):
    with client.responses.stream(model="fake-model", input="short-one helper") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == "Done." == final.output_text
    assert client.responses.retrieve(final.id).output_text == "Done."  # streamed responses are stored too


def test_client_stream_helper_with_a_tool_call(client: openai.OpenAI):
    with client.responses.stream(model="fake-model", input="call-weather helper", tools=[WEATHER]) as stream:
        final = stream.get_final_response()
    call = final.output[-1]
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Zürich"}


def test_streamed_incomplete_ends_with_response_incomplete(harness: Harness):
    events = harness.sse({"input": "anything", "max_output_tokens": 3})
    assert _names(events)[-1] == "response.incomplete"
    assert events[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_engine_failure_is_an_error_status(harness: Harness):
    r = harness.request("POST", "/v1/responses", {"input": "engine-fails whole"})
    assert r.status == 500 and "boom" in r.json()["error"]["message"]


def test_streamed_engine_failure_ends_with_response_failed(harness: Harness):
    events = harness.sse({"input": "engine-fails streamed"})
    assert _names(events)[:2] == ["response.created", "response.in_progress"]
    assert _names(events)[-2:] == ["error", "response.failed"]
    assert "boom" in events[-2][1]["message"]
    failed = events[-1][1]["response"]
    assert failed["status"] == "failed" and "boom" in failed["error"]["message"]


# ---------------------------------------------------------------- step 4: background, cancel


def _poll(client: openai.OpenAI, response_id: str, until: set[str]) -> Any:
    for _ in range(500):
        out = client.responses.retrieve(response_id)
        if out.status in until:
            return out
        time.sleep(0.02)
    raise AssertionError(f"{response_id} never reached {until}: {out.status}")


def test_background_response_completes_and_is_read_by_get(client: openai.OpenAI):
    out = client.responses.create(model="fake-model", input="short-one background", background=True)
    assert out.background is True and out.status == "queued" and out.output == []
    done = _poll(client, out.id, {"completed"})
    assert done.output_text == "Done." and done.usage is not None and done.background is True
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.cancel(out.id)
    assert "it is completed" in str(e.value)


def test_cancel_stops_a_running_background_response(client: openai.OpenAI, harness: Harness):
    out = client.responses.create(model="fake-model", input="never-ends background", background=True)
    add = harness.add_request("never-ends background")
    assert add.rid.endswith(":" + out.id)  # the front door prefixes its client id
    assert client.responses.retrieve(out.id).status in ("queued", "in_progress")
    cancelled = client.responses.cancel(out.id)
    assert cancelled.status == "cancelled" and cancelled.id == out.id
    harness.scheduler.wait_for(lambda m: isinstance(m, AbortRequest) and m.rid == add.rid)
    assert client.responses.retrieve(out.id).status == "cancelled"
    assert client.responses.cancel(out.id).status == "cancelled"  # again: the same answer
    # a cancelled turn (no output) can still be continued (in the background: the prompt holds again)
    after = client.responses.create(model="fake-model", input="next turn", previous_response_id=out.id, background=True)
    assert harness.prompt_of("next turn") == (
        "<|user|>\nnever-ends background<|endoftext|>\n<|user|>\nnext turn<|endoftext|>\n<|assistant|>\n"
    )
    client.responses.cancel(after.id)


def test_delete_stops_a_running_background_response(client: openai.OpenAI, harness: Harness):
    out = client.responses.create(model="fake-model", input="never-ends deleted", background=True)
    add = harness.add_request("never-ends deleted")
    client.responses.delete(out.id)
    harness.scheduler.wait_for(lambda m: isinstance(m, AbortRequest) and m.rid == add.rid)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(out.id)


def test_cancel_refusals(client: openai.OpenAI, harness: Harness):
    out = client.responses.create(model="fake-model", input="short-one foreground")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.cancel(out.id)
    assert "only background responses" in str(e.value)
    r = harness.request("POST", "/v1/responses/resp_nope/cancel")
    assert r.status == 404 and "resp_nope" in r.json()["error"]["message"]


def test_continuing_a_running_response_is_refused(client: openai.OpenAI, harness: Harness):
    out = client.responses.create(model="fake-model", input="never-ends again", background=True)
    r = harness.request("POST", "/v1/responses", {"input": "x", "previous_response_id": out.id})
    assert r.status == 400 and "is still" in r.json()["error"]["message"]
    client.responses.cancel(out.id)


@pytest.fixture(scope="module")
def storeless(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer: Tokenizer) -> Iterator[Harness]:
    """A server that keeps no responses (--responses-store-max 0)."""
    with _serving(tmp_path_factory.mktemp("storeless-model"), demo_tokenizer, responses_store_max=0) as h:
        yield h


def test_a_server_that_stores_nothing(storeless: Harness):
    r = storeless.request("POST", "/v1/responses", {"input": "short-one"})
    assert r.status == 200 and r.json()["store"] is False
    assert storeless.request("GET", f"/v1/responses/{r.json()['id']}").status == 404
    r = storeless.request("POST", "/v1/responses", {"input": "short-one", "background": True})
    assert r.status == 400 and "--responses-store-max is 0" in r.json()["error"]["message"]


def test_logit_bias_is_passed_on_and_checked(harness: Harness):
    """An extension, as on chat: {token id: bias} reaches the engine; bad ones are 400s."""
    r = harness.request("POST", "/v1/responses", {"input": "bias-resp", "logit_bias": {"12": 100}})
    assert r.status == 200, r.body
    assert harness.add_request("bias-resp").sampling.logit_bias == {12: 100.0}
    for bias, words in (({"x": 1}, "keys are token ids"), ({"12": 101}, "out of range [-100, 100]")):
        r = harness.request("POST", "/v1/responses", {"input": "bias-bad", "logit_bias": bias})
        assert r.status == 400 and words in r.json()["error"]["message"], r.body


def test_previous_response_id_extends_the_stored_token_ids(client: openai.OpenAI, harness: Harness):
    """The next turn's prompt is the stored turn's ids (prompt and output, as generated) then the
    template's end of that turn and the new input as the next turn: an exact extension."""
    harness.scheduler.replies["ends-with-eos"] = "Closed turn.<|endoftext|>"
    first = client.responses.create(model="fake-model", input="ext-one ends-with-eos", instructions="rules")
    second = client.responses.create(
        model="fake-model", input="ext-two", previous_response_id=first.id, instructions="rules"
    )
    one, two = harness.add_request("ext-one"), harness.add_request("ext-two")
    output_ids = harness.tokenizer.encode("Closed turn.<|endoftext|>").ids
    assert output_ids[-1] == 0  # the model closed its turn with EOS: it is not written twice
    assert two.input_ids == [
        *one.input_ids,
        *output_ids,
        *harness.tokenizer.encode("\n<|user|>\next-two<|endoftext|>\n<|assistant|>\n").ids,
    ]
    # cut by max_output_tokens: the template's end of turn (EOS included) closes it
    third = client.responses.create(
        model="fake-model", input="ext-three", previous_response_id=second.id, instructions="rules", max_output_tokens=2
    )
    assert third.status == "incomplete"
    client.responses.create(model="fake-model", input="ext-four", previous_response_id=third.id, instructions="rules")
    three, four = harness.add_request("ext-three"), harness.add_request("ext-four")
    cut = output_ids[:2]  # the fake model answers the same: its prompt still holds "ends-with-eos"
    closing = harness.tokenizer.encode("<|endoftext|>\n<|user|>\next-four<|endoftext|>\n<|assistant|>\n").ids
    assert four.input_ids == [*three.input_ids, *cut, *closing]
