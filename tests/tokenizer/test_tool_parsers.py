"""Tool-call and reasoning parsers on recorded answers in each family's format: the whole parse
is what the format says, and streamed — split at every byte, or one byte at a time — the deltas
are shaped as OpenAI sends them and join to the same message."""

from __future__ import annotations

import codecs
import itertools
import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from himamba.services.tokenizer.reasoning_parser import ThinkParser, prompt_opened_thinking
from himamba.services.tokenizer.tool_parsers import detect_tool_parser, make_tool_parser
from himamba.services.tokenizer.tool_parsers.forced import NamedCall, RequiredCalls
from himamba.services.tokenizer.tool_parsers.streaming import AnswerShaper
from himamba.services.tokenizer.tool_parsers.xml_calls import convert_parameter

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "hours": {"type": "array", "items": {"type": "integer"}},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]

Case = tuple[str, str | None, bool, str, dict[str, Any]]  # id, tool parser, think, text, expected
# expected: content, reasoning (None when no reasoning parser), calls [(name, arguments as a dict)]

RECORDED: list[Case] = [
    (
        "qwen3_next_hermes",  # Qwen3-Next: <tool_call>\n{json}\n</tool_call>, one block per call
        "hermes",
        False,
        'I will look it up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 3}}\n'
        '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
        {"content": "I will look it up.", "calls": [("get_weather", {"city": "Zürich", "days": 3}), ("now", {})]},
    ),
    (
        "granite4_hermes",  # Granite-4.0-H (IBM's prompt guide): the same tags; nested values
        "hermes",
        False,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京", "hours": [1, 2], "metric": true}}\n'
        "</tool_call>",
        {"content": None, "calls": [("get_weather", {"city": "東京", "hours": [1, 2], "metric": True})]},
    ),
    (
        "falcon_h1_hermes_array",  # Falcon-H1's template: a JSON array of calls inside one <tool_call>
        "hermes",
        False,
        '<tool_call>\n[\n  {"name": "get_weather", "arguments": {"city": "Paris"}},\n'
        '  {"name": "now", "arguments": {}}\n]\n</tool_call>',
        {"content": None, "calls": [("get_weather", {"city": "Paris"}), ("now", {})]},
    ),
    (
        "falcon_h1_openai_shape",  # its history is rendered with tojson: the model may echo OpenAI's shape
        "hermes",
        False,
        '<tool_call>\n[{"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]\n'
        "</tool_call>",
        {"content": None, "calls": [("now", {})]},
    ),
    (
        "falcon_h1_hermes_args_first",  # keys in the other order, arguments as a JSON string
        "hermes",
        False,
        '<tool_call>{"arguments": "{\\"city\\": \\"Paris\\"}", "name": "get_weather"}</tool_call>',
        {"content": None, "calls": [("get_weather", {"city": "Paris"})]},
    ),
    (
        "hermes_escapes_in_strings",  # braces and tags inside strings do not end anything
        "hermes",
        False,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a}\\"{[b</tool"}}\n</tool_call>',
        {"content": None, "calls": [("get_weather", {"city": 'a}"{[b</tool'})]},
    ),
    (
        "hermes_not_json_stays_content",
        "hermes",
        False,
        "Sure <tool_call>not a call</tool_call> done",
        {"content": "Sure <tool_call>not a call</tool_call> done", "calls": []},
    ),
    (
        "hermes_plain_answer",
        "hermes",
        False,
        "The weather in Paris is <b>sunny</b>, 21°C.  ",
        {"content": "The weather in Paris is <b>sunny</b>, 21°C.  ", "calls": []},
    ),
    (
        "hermes_cut_short",  # max_tokens inside the block: the call stays, arguments as far as they got
        "hermes",
        False,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
        {"content": None, "calls": [("get_weather", '{"city": "Pa')]},
    ),
    (
        "nemotron_h_toolcall_list",  # Nemotron-H / Nano v2: one <TOOLCALL> holding a JSON list
        "nemotron_json",
        False,
        'Checking both.<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}]</TOOLCALL>',
        {
            "content": "Checking both.",
            "calls": [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome", "days": 2})],
        },
    ),
    (
        "nemotron_nano_v2_thinking",  # the template opened <think> in the prompt
        "nemotron_json",
        True,
        'The user wants the weather.\n</think>\n\n<TOOLCALL>[{"name": "now", "arguments": {}}]</TOOLCALL>',
        {"content": None, "reasoning": "The user wants the weather.\n", "calls": [("now", {})]},
    ),
    (
        "qwen3_coder_xml",  # Qwen3-Coder / Nemotron 3: XML parameters, typed by the schema
        "qwen3_coder",
        False,
        "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nfalse\n</parameter>\n"
        "<parameter=hours>\n[6, 18]\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n"
        "</function>\n</tool_call>",
        {
            "content": "Let me check.",
            "calls": [
                ("get_weather", {"city": "São Paulo", "days": 3, "metric": False, "hours": [6, 18]}),
                ("now", {}),
            ],
        },
    ),
    (
        "qwen3_coder_multiline_string",
        "qwen3_coder",
        False,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nline one\nline <two>\n</parameter>\n</function>\n"
        "</tool_call>",
        {"content": None, "calls": [("get_weather", {"city": "line one\nline <two>"})]},
    ),
    (
        "llama31_json_python_tag",  # Llama 3.1: <|python_tag|> then {"name", "parameters"} (its template's words)
        "llama3_json",
        False,
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
        {"content": None, "calls": [("get_weather", {"city": "Paris", "days": 2})]},
    ),
    (
        "llama32_json_calls_separated_by_semicolons",
        "llama3_json",
        False,
        '{"name": "get_weather", "parameters": {"city": "Oslo", "hours": [9]}}; {"name": "now", "parameters": {}}',
        {"content": None, "calls": [("get_weather", {"city": "Oslo", "hours": [9]}), ("now", {})]},
    ),
    (
        "llama3_json_plain_answer",
        "llama3_json",
        False,
        "  The weather in {Paris} is fine.",
        {"content": "  The weather in {Paris} is fine.", "calls": []},
    ),
    (
        "llama3_json_object_that_is_no_call",  # a JSON answer without a name: it is the content
        "llama3_json",
        False,
        '{"answer": 42}',
        {"content": '{"answer": 42}', "calls": []},
    ),
    (
        "mistral_v3_json_list",  # Mistral 7B v0.3 / Nemo: [TOOL_CALLS] then a JSON list (ids echoed)
        "mistral",
        False,
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "metric": false}, "id": "a1b2c3d4e"}, '
        '{"name": "now", "arguments": {}}]',
        {"content": None, "calls": [("get_weather", {"city": "Paris", "metric": False}), ("now", {})]},
    ),
    (
        "mistral_v11_name_args",  # Mistral Small 3.2 / Magistral / Devstral: name[ARGS]{...} per call
        "mistral",
        False,
        'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich", "hours": [1, 2]}[TOOL_CALLS]now[ARGS]{}',
        {"content": "Let me check.", "calls": [("get_weather", {"city": "Zürich", "hours": [1, 2]}), ("now", {})]},
    ),
    (
        "mistral_call_id_and_braces_in_strings",
        "mistral",
        False,
        '[TOOL_CALLS]get_weather[CALL_ID]x9Y8z7W6v[ARGS]{"city": "a}\\"{b[TOOL"}',
        {"content": None, "calls": [("get_weather", {"city": 'a}"{b[TOOL'})]},
    ),
    (
        "mistral_plain_answer",
        "mistral",
        False,
        "No tool is needed: [1] says so.",
        {"content": "No tool is needed: [1] says so.", "calls": []},
    ),
    (
        "mistral_not_a_call_stays_content",
        "mistral",
        False,
        "Use [TOOL_CALLS] like this: (see docs)",
        {"content": "Use [TOOL_CALLS] like this: (see docs)", "calls": []},
    ),
    (
        "llama32_pythonic",  # Llama 3.2's pythonic template: [func_name1(params_name1=params_value1, ...)]
        "pythonic",
        False,
        '[get_weather(city="San Francisco", days=3, metric=True, hours=[6, 18]), now()]',
        {
            "content": None,
            "calls": [
                ("get_weather", {"city": "San Francisco", "days": 3, "metric": True, "hours": [6, 18]}),
                ("now", {}),
            ],
        },
    ),
    (
        "pythonic_brackets_and_quotes_in_strings",
        "pythonic",
        False,
        '[get_weather(city=\'a) ], "b\', hours=(1, 2)), get_weather(city="""x\nsays "hi")""")]',
        {
            "content": None,
            "calls": [
                ("get_weather", {"city": 'a) ], "b', "hours": [1, 2]}),
                ("get_weather", {"city": 'x\nsays "hi")'}),
            ],
        },
    ),
    (
        # An escaped quote just before the closing triple quote: Python reads `a"`, then the call ends.
        "pythonic_escaped_quote_before_closing_triple_quote",
        "pythonic",
        False,
        "[get_weather(city=\"\"\"a\\\"\"\"\"), get_weather(city='''b\\'''')]",
        {"content": None, "calls": [("get_weather", {"city": 'a"'}), ("get_weather", {"city": "b'"})]},
    ),
    (
        "pythonic_plain_answer",
        "pythonic",
        False,
        "[1, 2, 3] are the numbers.",
        {"content": "[1, 2, 3] are the numbers.", "calls": []},
    ),
    (
        "pythonic_expression_is_not_a_call",  # never evaluated: only literals are arguments
        "pythonic",
        False,
        "[get_weather(city=__import__('os').getcwd())]",
        {"content": "[get_weather(city=__import__('os').getcwd())]", "calls": []},
    ),
    (
        "granite3_tool_call_list",  # Granite 3.x: <|tool_call|> then a JSON list
        "granite",
        False,
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}]',
        {"content": None, "calls": [("get_weather", {"city": "Paris"}), ("now", {})]},
    ),
    (
        "granite3_plain_answer",
        "granite",
        False,
        "Paris is sunny today.",
        {"content": "Paris is sunny today.", "calls": []},
    ),
    (
        "qwen3_thinking_then_answer",  # the answer opens <think> itself
        None,
        False,
        "<think>\nThe user greets me. ünï\n</think>\n\nHello! How can I help?",
        {"content": "Hello! How can I help?", "reasoning": "\nThe user greets me. ünï\n", "calls": []},
    ),
    (
        "qwen3_thinking_with_xml_call",
        "qwen3_coder",
        False,
        "<think>I need the tool <tool_call> here.</think>\n<tool_call>\n<function=now>\n</function>\n</tool_call>",
        {"content": None, "reasoning": "I need the tool <tool_call> here.", "calls": [("now", {})]},
    ),
    (
        "no_thinking_at_all",
        None,
        False,
        "Just an answer with a </think>-free body.",
        {"content": "Just an answer with a </think>-free body.", "reasoning": None, "calls": []},
    ),
]


def _thinks(case: Case) -> bool:
    return "reasoning" in case[4]


def _shaper(case: Case) -> AnswerShaper:
    _, parser, opened, _, _ = case
    think = ThinkParser("qwen3", opened) if _thinks(case) else None
    tools = make_tool_parser(parser, TOOLS) if parser else None
    return AnswerShaper(reasoning=think, tools=tools)


def _run(case: Case, pieces: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    shaper = _shaper(case)
    deltas: list[dict[str, Any]] = []
    for piece in pieces:
        deltas += shaper.feed(piece)
    deltas += shaper.finish()
    return shaper.message(), deltas


def _byte_pieces(text: str, cuts: list[int]) -> list[str]:
    """`text` as a client receives it when its UTF-8 bytes are cut at `cuts`."""
    data = text.encode()
    decoder = codecs.getincrementaldecoder("utf-8")()
    bounds = [0, *cuts, len(data)]
    return [decoder.decode(data[a:b], final=b == len(data)) for a, b in zip(bounds, bounds[1:])]


def _joined(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """The message a client rebuilds from the deltas, checking their shape on the way."""
    content, reasoning, calls = "", "", []
    for d in deltas:
        assert d, "no empty deltas"
        content += d.get("content", "")
        reasoning += d.get("reasoning_content", "")
        for tc in d.get("tool_calls", []):
            assert set(d) == {"tool_calls"} and len(d["tool_calls"]) == 1
            if "id" in tc:  # a call's first delta: id, type, name and empty arguments
                assert tc["index"] == len(calls) and tc["id"].startswith("call_") and tc["type"] == "function"
                assert tc["function"]["arguments"] == "" and tc["function"]["name"]
                calls.append({"id": tc["id"], "name": tc["function"]["name"], "arguments": ""})
            else:  # then arguments fragments under the same index
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                assert tc["index"] == len(calls) - 1 and tc["function"]["arguments"]
                calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    return {"content": content, "reasoning": reasoning, "calls": calls}


def _check_message(case: Case, msg: dict[str, Any]) -> None:
    expected = case[4]
    assert msg["content"] == expected["content"]
    if _thinks(case):
        assert msg["reasoning_content"] == expected["reasoning"]
    else:
        assert "reasoning_content" not in msg
    calls = msg.get("tool_calls", [])
    assert [c["function"]["name"] for c in calls] == [name for name, _ in expected["calls"]]
    for call, (_, args) in zip(calls, expected["calls"], strict=True):
        got = call["function"]["arguments"]
        assert (json.loads(got) if isinstance(args, dict) else got) == args
        assert call["type"] == "function" and call["id"].startswith("call_")


def _same(msg: dict[str, Any], joined: dict[str, Any]) -> None:
    assert joined["content"] == (msg["content"] or "")
    assert joined["reasoning"] == (msg.get("reasoning_content") or "")
    assert [(c["name"], c["arguments"]) for c in joined["calls"]] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])
    ]
    assert [c["id"] for c in joined["calls"]] == [c["id"] for c in msg.get("tool_calls", [])]


@pytest.mark.parametrize("case", RECORDED, ids=[c[0] for c in RECORDED])
def test_whole_answer_parses_as_recorded(case: Case):
    msg, deltas = _run(case, [case[3]])
    _check_message(case, msg)
    _same(msg, _joined(deltas))


@pytest.mark.parametrize("case", RECORDED, ids=[c[0] for c in RECORDED])
def test_split_at_every_byte_joins_to_the_whole_parse(case: Case):
    whole, _ = _run(case, [case[3]])
    n = len(case[3].encode())
    for cut in range(1, n):
        msg, deltas = _run(case, _byte_pieces(case[3], [cut]))
        assert _strip_ids(msg) == _strip_ids(whole), f"split at byte {cut}"
        _same(msg, _joined(deltas))
    # and one byte at a time
    msg, deltas = _run(case, _byte_pieces(case[3], list(range(1, n))))
    assert _strip_ids(msg) == _strip_ids(whole)
    _same(msg, _joined(deltas))


def _strip_ids(msg: dict[str, Any]) -> dict[str, Any]:
    out = dict(msg)
    if "tool_calls" in out:
        out["tool_calls"] = [{**c, "id": "-"} for c in out["tool_calls"]]
    return out


def test_arguments_stream_before_the_call_ends():
    """A long arguments object reaches the client while it is being written, not at the end."""
    shaper = AnswerShaper(reasoning=None, tools=make_tool_parser("hermes", TOOLS))
    head = shaper.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    assert head[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert head[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Par'
    assert shaper.feed('is"}}\n')[0]["tool_calls"][0]["function"]["arguments"] == 'is"}'
    assert shaper.feed("</tool_call>") == [] and shaper.finish() == []


def test_parallel_tool_calls_false_keeps_the_first_call():
    case = RECORDED[0]
    shaper = AnswerShaper(reasoning=None, tools=make_tool_parser("hermes", TOOLS), max_calls=1)
    deltas = shaper.feed(case[3]) + shaper.finish()
    assert [c["function"]["name"] for c in shaper.message()["tool_calls"]] == ["get_weather"]
    assert all(tc["index"] == 0 for d in deltas for tc in d.get("tool_calls", []))


@pytest.mark.parametrize(
    ("kind", "opened", "text", "reasoning", "content"),
    [
        ("qwen3", False, "<think>a</think>b", "a", "b"),
        ("qwen3", False, "  <think>a</think>  b", "a", "b"),
        ("qwen3", False, "no think", None, "no think"),
        ("qwen3", True, "still thinking, cut short", "still thinking, cut short", ""),
        ("qwen3", True, "x</think>", "x", ""),
        ("deepseek_r1", False, "reason</think>answer", "reason", "answer"),
        ("deepseek_r1", False, "<think>reason</think>answer", "reason", "answer"),
        ("qwen3", False, "<thin", None, "<thin"),  # a cut-short tag is text
    ],
)
def test_think_parser(kind: str, opened: bool, text: str, reasoning: str | None, content: str):
    for cut in range(len(text) + 1):
        shaper = AnswerShaper(reasoning=ThinkParser(kind, opened), tools=None)
        shaper.feed(text[:cut])
        shaper.feed(text[cut:])
        shaper.finish()
        msg = shaper.message()
        assert (msg["reasoning_content"], msg["content"]) == (reasoning, content), cut


def test_prompt_opened_thinking():
    assert prompt_opened_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opened_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking false
    assert not prompt_opened_thinking("<|im_start|>assistant\n")


def test_named_and_required_answers():
    named = AnswerShaper(reasoning=None, tools=NamedCall("get_weather"), calls_finish=False)
    deltas = named.feed('{"city": ') + named.feed('"Oslo"}') + named.finish()
    msg = named.message()
    assert msg["content"] is None and json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    assert _joined(deltas)["calls"][0]["arguments"] == '{"city": "Oslo"}'
    assert named.finish_reason("stop") == "stop"  # OpenAI: a named function finishes with "stop"

    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "now", "parameters": {}}]'
    for cut in range(len(text) + 1):
        required = AnswerShaper(reasoning=None, tools=RequiredCalls())
        deltas = required.feed(text[:cut]) + required.feed(text[cut:]) + required.finish()
        msg = required.message()
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
            ("get_weather", {"city": "Oslo"}),
            ("now", {}),
        ]
        _same(msg, _joined(deltas))
        assert required.finish_reason("stop") == "tool_calls" and required.finish_reason("length") == "length"


@pytest.mark.parametrize(
    ("raw", "json_type", "value"),
    [
        ("3", "integer", 3),
        ("3.5", "number", 3.5),
        ("4", "number", 4),
        ("True", "boolean", True),
        ("007", "string", "007"),
        ('{"a": 1}', "object", {"a": 1}),
        ("[1, 2]", None, [1, 2]),
        ("not json", None, "not json"),
        ("x", "integer", "x"),
        ("null", ["string", "null"], "null"),
        ("null", ["integer", "null"], None),
    ],
)
def test_xml_parameter_values_follow_the_schema(raw: str, json_type: Any, value: Any):
    assert convert_parameter(raw, json_type) == value


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        ("{{ '<TOOLCALL>[' }}...", "nemotron_json"),
        ("<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>", "qwen3_coder"),
        ('<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>', "hermes"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
    ],
)
def test_auto_detects_the_templates_format(template: str, parser: str | None):
    assert detect_tool_parser(template) == parser


def test_unknown_parser_names_are_refused():
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        make_tool_parser("nope", None)
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ThinkParser("nope", False)


Feed = Callable[[str], list[dict[str, Any]]]


def test_xml_string_parameters_stream_as_they_are_written():
    """A string parameter (a file's contents, say) reaches the client while it is being written."""
    shaper = AnswerShaper(reasoning=None, tools=make_tool_parser("qwen3_coder", TOOLS))
    deltas = shaper.feed('<tool_call>\n<function=get_weather>\n<parameter=city>\nLine "one"\nline two and more')
    sent = "".join(tc["function"]["arguments"] for d in deltas for tc in d["tool_calls"] if "id" not in tc)
    assert sent == '{"city": "Line \\"one\\"\\nline '  # JSON-escaped; the last 12 characters held back
    deltas += shaper.feed(" text\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")
    deltas += shaper.finish()
    (call,) = shaper.message()["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": 'Line "one"\nline two and more text', "days": 2}
    assert _joined(deltas)["calls"][0]["arguments"] == call["function"]["arguments"]


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (
            "hermes",
            '<tool_call>{"name": "now", "arguments": {"a": tru!}}</tool_call><tool_call>{"name": "now"}</tool_call>',
        ),
        (
            "qwen3_coder",
            "<tool_call><function=now>\n<oops></tool_call><tool_call><function=now></function></tool_call>",
        ),
    ],
)
def test_a_broken_call_does_not_shift_the_next_ones(parser: str, text: str):
    """A call announced and then broken keeps its index: the next call is the next index."""
    for cut in range(len(text) + 1):
        shaper = AnswerShaper(reasoning=None, tools=make_tool_parser(parser, TOOLS))
        deltas = shaper.feed(text[:cut]) + shaper.feed(text[cut:]) + shaper.finish()
        calls = shaper.message()["tool_calls"]
        assert [c["function"]["name"] for c in calls] == ["now", "now"]
        assert calls[1]["function"]["arguments"] == "{}"
        _same(shaper.message(), _joined(deltas))


_PIECES = [
    "<tool_call>", "</tool_call>", "<TOOLCALL>", "</TOOLCALL>", "<think>", "</think>", "<function=", "<parameter=",
    "</parameter>", "</function>", '{"name": "now", "arguments": ', '{"name": "get_weather"', '"arguments": {"city": ',
    '"x"', "{", "}", "[", "]", ",", ":", '"', "\\", " ", "\n", "now>", "city>", "é", "text", "<", "tru",
    "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "now", "<|python_tag|>", "<|tool_call|>", '"parameters": {}', ";",
    "get_weather(", "city=", ")", "(", "'", '"""', "now()", "3",
]  # fmt: skip


@settings(max_examples=600, deadline=None)
@given(
    parts=st.lists(st.sampled_from(_PIECES), max_size=14),
    cuts=st.lists(st.integers(0, 400), max_size=5),
    parser=st.sampled_from(
        ["hermes", "nemotron_json", "qwen3_coder", "llama3_json", "mistral", "pythonic", "granite", None]
    ),
    think=st.sampled_from([None, "qwen3", "deepseek_r1"]),
)
def test_any_text_parses_the_same_however_it_is_split(parts: list[str], cuts: list[int], parser, think):
    """Whatever the model writes (broken tags, half calls), the streamed deltas join to the whole parse."""
    text = "".join(parts)

    def run(pieces: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        shaper = AnswerShaper(
            reasoning=ThinkParser(think, False) if think else None,
            tools=make_tool_parser(parser, TOOLS) if parser else None,
        )
        deltas = [d for p in pieces for d in shaper.feed(p)] + shaper.finish()
        return shaper.message(), deltas

    whole, _ = run([text])
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    from himamba.services.tokenizer.tool_parsers import xml_calls

    xml_calls._TRIM_STEP = 0  # drop text behind the scan at every step (restored below)
    try:
        msg, deltas = run([text[a:b] for a, b in itertools.pairwise(bounds)])
    finally:
        xml_calls._TRIM_STEP = 4096
    assert _strip_ids(msg) == _strip_ids(whole)
    _same(msg, _joined(deltas))
    msg, deltas = run([text[a:b] for a, b in itertools.pairwise(bounds)])
    assert _strip_ids(msg) == _strip_ids(whole)
    _same(msg, _joined(deltas))


def test_parser_settings_resolve_against_the_template():
    from himamba.services.tokenizer.http.chat_parsing import resolve_reasoning_parser, resolve_tool_parser

    qwen3_like = "<tool_call>\n{...}\n</tool_call> {% if enable_thinking %}<think>\n{% endif %}"
    assert resolve_tool_parser("auto", qwen3_like) == "hermes"
    assert resolve_tool_parser("auto", "no format here") is None
    assert resolve_tool_parser("none", qwen3_like) is None
    assert resolve_tool_parser("nemotron_json", "anything") == "nemotron_json"  # an explicit choice wins
    assert resolve_reasoning_parser("auto", qwen3_like) == "qwen3"
    assert resolve_reasoning_parser("auto", "no thinking") is None
    assert resolve_reasoning_parser("none", qwen3_like) is None
    assert resolve_reasoning_parser("deepseek_r1", None) == "deepseek_r1"


@pytest.mark.parametrize("trim_step", [0, 1, 4096])
def test_long_xml_values_stream_in_pieces(trim_step: int, monkeypatch: pytest.MonkeyPatch):
    """Long values (a file's contents, a big array) parse the same in any pieces, with the text
    behind the scan dropped as it goes (at every step when trim_step is 0)."""
    from himamba.services.tokenizer.tool_parsers import xml_calls

    monkeypatch.setattr(xml_calls, "_TRIM_STEP", trim_step)
    content = "".join(f'line {i} <tag> "q" é\n' for i in range(900))
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n" + content + "\n</parameter>\n"
        "<parameter=hours>\n" + json.dumps(list(range(1500))) + "\n</parameter>\n</function>\n</tool_call>"
    )
    expected = {"city": content, "hours": list(range(1500))}
    for size in (1, 7, 4097, len(text)):
        shaper = AnswerShaper(reasoning=None, tools=make_tool_parser("qwen3_coder", TOOLS))
        deltas = [d for i in range(0, len(text), size) for d in shaper.feed(text[i : i + size])] + shaper.finish()
        (call,) = shaper.message()["tool_calls"]
        assert json.loads(call["function"]["arguments"]) == expected, size
        _same(shaper.message(), _joined(deltas))


# The tool-call instructions of real chat templates (their words, abridged), and the format each teaches.
GRANITE_4_TEMPLATE = (  # ibm-granite/granite-4.0-h-*: hermes-style blocks in its tools system message
    "{%- set tools_system_message_suffix = '\\n</tools>\\n\\nFor each tool call, return a json object with function "
    'name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\\n</tool_call>. If a tool does not exist in the provided list of tools, '
    "notify the user that you do not have the ability to fulfill the request.' %}"
    "{{- '<|start_of_role|>' + message.role + '<|end_of_role|>' }}"
)
GRANITE_3_TEMPLATE = (  # granite-3.x-instruct: calls as a JSON list after <|tool_call|>
    "{%- if message['role'] == 'assistant_tool_call' %}"
    "{{- '<|start_of_role|>assistant<|end_of_role|><|tool_call|>' + message['content'] + '<|end_of_text|>\\n' }}"
)
LLAMA_31_TEMPLATE = (
    '{{- "Given the following functions, please respond with a JSON for a function call with its proper '
    'arguments that best answers the given prompt.\\n\\n" }}'
    '{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
    "value}.' }}{{- \"Do not use variables.\\n\\n\" }}{{- '<|python_tag|>' + tool_call.name + '.call(' }}"
)
LLAMA_32_PYTHONIC_TEMPLATE = (
    '{{- "If you decide to invoke any of the function(s), you MUST put it in the format of '
    '[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]\\n\\n" }}'
)
MISTRAL_TEMPLATE = (
    '{{- "[AVAILABLE_TOOLS] [" }}...{{- "[/AVAILABLE_TOOLS]" }}'
    '{{- "[TOOL_CALLS] [" }}{%- for tool_call in message.tool_calls %}...{{- raise_exception("Tool call IDs '
    'should be alphanumeric strings with length 9!") }}'
)


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        (GRANITE_4_TEMPLATE, "hermes"),
        (GRANITE_3_TEMPLATE, "granite"),
        (LLAMA_31_TEMPLATE, "llama3_json"),
        (LLAMA_32_PYTHONIC_TEMPLATE, "pythonic"),
        (MISTRAL_TEMPLATE, "mistral"),
    ],
)
def test_auto_detects_the_new_formats_from_real_templates(template: str, parser: str):
    assert detect_tool_parser(template) == parser


def _arguments_sent(deltas: list[dict[str, Any]]) -> str:
    return "".join(tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", []) if "id" not in tc)


def test_new_formats_stream_their_calls_before_the_answer_ends():
    """JSON arguments (llama3_json, mistral) stream as they are written; a pythonic call goes out
    when its parenthesis closes, before the list does."""
    for parser, head, tail in (
        ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Pa', 'ris"}}'),
        ("mistral", 'OK[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', 'ris"}'),
        ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Pa', 'ris"}}]'),
    ):
        shaper = AnswerShaper(reasoning=None, tools=make_tool_parser(parser, TOOLS))
        deltas = shaper.feed(head)
        assert any(
            tc.get("function", {}).get("name") == "get_weather" for d in deltas for tc in d.get("tool_calls", [])
        )
        assert _arguments_sent(deltas) == '{"city": "Pa', parser
        deltas += shaper.feed(tail) + shaper.finish()
        assert json.loads(_arguments_sent(deltas)) == {"city": "Paris"}
    shaper = AnswerShaper(reasoning=None, tools=make_tool_parser("pythonic", TOOLS))
    assert shaper.feed('[get_weather(city="Paris"') == []
    deltas = shaper.feed("), now(")
    assert json.loads(_arguments_sent(deltas)) == {"city": "Paris"}
    deltas = shaper.feed(")]") + shaper.finish()
    assert [c["function"]["name"] for c in shaper.message()["tool_calls"]] == ["get_weather", "now"]


@pytest.mark.parametrize(
    "parser", ["hermes", "nemotron_json", "qwen3_coder", "llama3_json", "mistral", "pythonic", "granite"]
)
def test_grammar_enforced_tool_choice_works_under_every_format(parser: str):
    """tool_choice required / named are a JSON grammar whatever the model's own format; the call
    ids are the ones the format's template takes back (Mistral's: 9 letters or digits)."""
    from himamba.common.config import HttpConfig
    from himamba.services.tokenizer.http.chat_parsing import ChatParsing

    parsing = ChatParsing(HttpConfig(tool_call_parser=parser), None)
    plan = parsing.plan(TOOLS, "required", True)
    assert plan.grammar is not None and plan.grammar.kind == "json_schema"
    make = parsing.shaping(plan, TOOLS, "prompt")
    assert make is not None
    shaper = make()
    shaper.feed('[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    shaper.finish()
    (call,) = shaper.message()["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    if parser == "mistral":
        assert len(call["id"]) == 9 and call["id"].isalnum()
    else:
        assert call["id"].startswith("call_")
    named = parsing.plan(TOOLS, {"type": "function", "function": {"name": "now"}}, True)
    make = parsing.shaping(named, TOOLS, "prompt")
    assert make is not None
    shaper = make()
    shaper.feed("{}")
    shaper.finish()
    assert shaper.message()["tool_calls"][0]["function"] == {"name": "now", "arguments": "{}"}


def test_required_calls_cut_short_keep_only_the_complete_ones():
    """tool_choice required cut by max_tokens at any point: the calls that closed, each with valid
    JSON arguments, streamed the same as whole; never part of a call."""
    text = (
        '[{"name": "get_weather", "parameters": {"city": "Oslo", "hours": [1, 2]}}, {"name": "now", "parameters": {}}]'
    )
    first_closes = text.index("}}") + 2
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut]], [text[i : i + 1] for i in range(cut)]):
            shaper = AnswerShaper(reasoning=None, tools=RequiredCalls())
            deltas = [d for p in pieces for d in shaper.feed(p)] + shaper.finish()
            msg = shaper.message()
            calls = msg.get("tool_calls", [])
            for call in calls:
                json.loads(call["function"]["arguments"])  # never a call with invalid arguments
            want = 0 if cut < first_closes else 1 if cut < len(text) - 1 else 2
            assert len(calls) == want, (cut, calls)
            assert msg["content"] in ("", None)
            _same(msg, _joined(deltas))
