"""Tool-call parsers: turn a model's answer into OpenAI `tool_calls`, streamed or whole.

One file per format (`--tool-call-parser`, vLLM's names):
- `hermes`: JSON inside `<tool_call>...</tool_call>` (Qwen3-Next, Granite-4.0-H, Falcon-H1);
- `nemotron_json`: `<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>` (Nemotron Nano v2);
- `qwen3_coder` (alias `qwen3_xml`): `<tool_call><function=name><parameter=p>v</parameter></function></tool_call>`
  (Qwen3-Coder, Nemotron 3).
`auto` picks the format from the chat template's text; streaming.py turns the parser's events
into OpenAI deltas and the final message.
"""

from __future__ import annotations

from typing import Any

from himamba.services.tokenizer.tool_parsers.events import StreamParser
from himamba.services.tokenizer.tool_parsers.json_calls import JsonCallScanner
from himamba.services.tokenizer.tool_parsers.tagged import TaggedCalls
from himamba.services.tokenizer.tool_parsers.xml_calls import XmlCallScanner

TOOL_PARSERS = ("hermes", "nemotron_json", "qwen3_coder", "qwen3_xml")


def make_tool_parser(name: str, tools: list[dict[str, Any]] | None) -> StreamParser:
    """A fresh parser of format `name` (one of TOOL_PARSERS) for one answer."""
    if name == "hermes":
        return TaggedCalls("<tool_call>", "</tool_call>", JsonCallScanner)
    if name == "nemotron_json":
        return TaggedCalls("<TOOLCALL>", "</TOOLCALL>", JsonCallScanner)
    if name in ("qwen3_coder", "qwen3_xml"):
        return TaggedCalls("<tool_call>", "</tool_call>", lambda first: XmlCallScanner(first, tools))
    raise ValueError(f"unknown tool-call parser {name!r} (known: {', '.join(TOOL_PARSERS)})")


def detect_tool_parser(template_source: str) -> str | None:
    """The format a chat template teaches its model (None: it shows no tool-call format)."""
    if "<TOOLCALL>" in template_source:
        return "nemotron_json"
    if "<function=" in template_source and "<parameter=" in template_source:
        return "qwen3_coder"
    if "<tool_call>" in template_source:
        return "hermes"
    return None
