"""Tool-call parsers: turn a model's answer into OpenAI `tool_calls`, streamed or whole.

One file per format (`--tool-call-parser`, vLLM's names):
- `hermes`: JSON inside `<tool_call>...</tool_call>` (Qwen3-Next, Granite-4.0-H, Falcon-H1);
- `nemotron_json`: `<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>` (Nemotron Nano v2);
- `qwen3_coder` (alias `qwen3_xml`): `<tool_call><function=name><parameter=p>v</parameter></function></tool_call>`
  (Qwen3-Coder, Nemotron 3);
- `llama3_json`: the answer is `{"name": ..., "parameters": {...}}` calls, after an optional
  `<|python_tag|>`, separated by `;` (Llama 3.1 / 3.2 / 3.3 JSON tool calling);
- `mistral`: `[TOOL_CALLS]` then a JSON list of calls, or `name[ARGS]{...}` per call (Mistral's
  tokenizers v3, and v11 and later);
- `pythonic`: the answer is `[name(k=v, ...), ...]` (Llama 3.2's pythonic template, ToolACE);
- `granite`: the answer is a JSON list of calls after `<|tool_call|>` (Granite 3.x). Granite 4.0
  (Granite-4.0-H) writes `<tool_call>` blocks: `hermes`, which `auto` picks from its template.
`auto` picks the format from the chat template's text; streaming.py turns the parser's events
into OpenAI deltas and the final message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from himamba.services.tokenizer.tool_parsers.events import StreamParser
from himamba.services.tokenizer.tool_parsers.json_calls import JsonCallScanner
from himamba.services.tokenizer.tool_parsers.leading import LeadingCalls
from himamba.services.tokenizer.tool_parsers.mistral_calls import MistralCallScanner
from himamba.services.tokenizer.tool_parsers.mistral_calls import call_id as mistral_call_id
from himamba.services.tokenizer.tool_parsers.pythonic_calls import PythonicCallScanner
from himamba.services.tokenizer.tool_parsers.streaming import tool_call_id
from himamba.services.tokenizer.tool_parsers.tagged import TaggedCalls
from himamba.services.tokenizer.tool_parsers.xml_calls import XmlCallScanner

TOOL_PARSERS = ("hermes", "nemotron_json", "qwen3_coder", "qwen3_xml", "llama3_json", "mistral", "pythonic", "granite")


def make_tool_parser(name: str, tools: list[dict[str, Any]] | None) -> StreamParser:
    """A fresh parser of format `name` (one of TOOL_PARSERS) for one answer."""
    if name == "hermes":
        return TaggedCalls("<tool_call>", "</tool_call>", JsonCallScanner)
    if name == "nemotron_json":
        return TaggedCalls("<TOOLCALL>", "</TOOLCALL>", JsonCallScanner)
    if name in ("qwen3_coder", "qwen3_xml"):
        return TaggedCalls("<tool_call>", "</tool_call>", lambda first: XmlCallScanner(first, tools))
    if name == "llama3_json":
        return LeadingCalls(("<|python_tag|>",), lambda first: JsonCallScanner(first, separators=",;"))
    if name == "mistral":
        return TaggedCalls("[TOOL_CALLS]", None, MistralCallScanner)
    if name == "pythonic":
        return LeadingCalls((), PythonicCallScanner)
    if name == "granite":
        return LeadingCalls(("<|tool_call|>", "<tool_call>"), JsonCallScanner)
    raise ValueError(f"unknown tool-call parser {name!r} (known: {', '.join(TOOL_PARSERS)})")


def call_id_maker(name: str | None) -> Callable[[], str]:
    """How tool-call ids are made for format `name`: OpenAI's shape, Mistral's where its templates
    check them."""
    return mistral_call_id if name == "mistral" else tool_call_id


# What each template family writes when it teaches (or replays) its format, most specific first.
_TEMPLATE_MARKS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("nemotron_json", ("<TOOLCALL>",)),
    ("qwen3_coder", ("<function=", "<parameter=")),
    ("mistral", ("[TOOL_CALLS]",)),
    ("granite", ("<|tool_call|>",)),  # Granite 3.x; Granite 4.0's <tool_call> is hermes
    ("hermes", ("<tool_call>",)),
    # Llama 3.2's pythonic template: "[func_name1(params_name1=params_value1, ...)]"
    ("pythonic", ("[func_name1(",)),
    # Llama 3.1 / 3.2 / 3.3: 'Respond in the format {"name": function name, "parameters": ...}'
    ("llama3_json", ('"parameters": dictionary of argument name',)),
)


def detect_tool_parser(template_source: str) -> str | None:
    """The format a chat template teaches its model (None: it shows no tool-call format)."""
    for name, marks in _TEMPLATE_MARKS:
        if all(mark in template_source for mark in marks):
            return name
    return None
