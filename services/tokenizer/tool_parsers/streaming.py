"""The streaming driver: one chat choice's text deltas in, OpenAI message deltas out.

The answer goes through the reasoning parser first (`<think>` → `reasoning_content`), then what
is left through the tool-call parser (→ `tool_calls`). Deltas are shaped as OpenAI sends them:
a call's first delta carries its `index`, `id`, `type` and `function.name` with empty
`arguments`, the next ones carry `arguments` fragments under the same index. The whole message
(stream=False) is the same parse fed the whole text at once, so the two always agree.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from himamba.services.tokenizer.tool_parsers.events import (
    Event,
    Reasoning,
    StreamParser,
    Text,
    ToolArgs,
    ToolStart,
)


def tool_call_id() -> str:
    """An id in OpenAI's shape (`call_` and 24 characters)."""
    return "call_" + uuid.uuid4().hex[:24]


class AnswerShaper:
    """One choice: `feed` text deltas, `finish` at the end; `message()` is the whole answer.

    `max_calls` (1 when parallel_tool_calls is false) drops the calls after the first ones;
    `calls_finish`: an answer that called tools finishes with "tool_calls" (OpenAI does so for
    tool_choice auto and required, not for a named function: "stop"); `call_id` makes the calls'
    ids (Mistral's templates want theirs: tool_parsers.call_id_maker)."""

    def __init__(
        self,
        *,
        reasoning: StreamParser | None,
        tools: StreamParser | None,
        max_calls: int | None = None,
        calls_finish: bool = True,
        call_id: Callable[[], str] = tool_call_id,
    ):
        self._calls_finish = calls_finish
        self._call_id = call_id
        self._reasoning = reasoning
        self._tools = tools
        self._max_calls = max_calls
        self._content: list[str] = []
        self._thinking: list[str] = []
        self._calls: list[dict[str, Any]] = []
        self._args: list[list[str]] = []  # each call's arguments fragments (joined by message())
        self._finished = False

    @property
    def called_tools(self) -> bool:
        return bool(self._calls)

    def finish_reason(self, reason: str) -> str:
        """The choice's finish reason, given the engine's."""
        return "tool_calls" if reason == "stop" and self._calls and self._calls_finish else reason

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The OpenAI deltas (without `role`) the new text settles; possibly none."""
        if not text:
            return []
        return self._deltas(self._parse(text))

    def finish(self) -> list[dict[str, Any]]:
        """The deltas of whatever the parsers held back."""
        if self._finished:
            return []
        self._finished = True
        events: list[Event] = []
        if self._reasoning is not None:
            events += self._after_reasoning(self._reasoning.finish())
        if self._tools is not None:
            events += self._tools.finish()
        return self._deltas(events)

    def message(self) -> dict[str, Any]:
        """The assistant message so far (after `finish`: the whole answer)."""
        content = "".join(self._content)
        msg: dict[str, Any] = {"role": "assistant", "content": content if content or not self._calls else None}
        if self._reasoning is not None:
            msg["reasoning_content"] = "".join(self._thinking) or None
        if self._calls:
            for call, fragments in zip(self._calls, self._args, strict=True):
                call["function"]["arguments"] = "".join(fragments)
            msg["tool_calls"] = self._calls
        return msg

    def _parse(self, text: str) -> list[Event]:
        if self._reasoning is not None:
            return self._after_reasoning(self._reasoning.feed(text))
        return self._tools.feed(text) if self._tools is not None else [Text(text)]

    def _after_reasoning(self, events: list[Event]) -> list[Event]:
        if self._tools is None:
            return events
        out: list[Event] = []
        for e in events:
            out += self._tools.feed(e.text) if isinstance(e, Text) else [e]
        return out

    def _deltas(self, events: list[Event]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, (ToolStart, ToolArgs)) and self._max_calls is not None and e.index >= self._max_calls:
                continue
            last = deltas[-1] if deltas else None
            if isinstance(e, Text):
                if not e.text:
                    continue
                self._content.append(e.text)
                if last is not None and set(last) == {"content"}:
                    last["content"] += e.text
                else:
                    deltas.append({"content": e.text})
            elif isinstance(e, Reasoning):
                if not e.text:
                    continue
                self._thinking.append(e.text)
                if last is not None and set(last) == {"reasoning_content"}:
                    last["reasoning_content"] += e.text
                else:
                    deltas.append({"reasoning_content": e.text})
            elif isinstance(e, ToolStart):
                call = {"id": self._call_id(), "type": "function", "function": {"name": e.name, "arguments": ""}}
                self._calls.append(call)
                self._args.append([])
                head = {"index": len(self._calls) - 1, **call, "function": {"name": e.name, "arguments": ""}}
                deltas.append({"tool_calls": [head]})
            else:
                index = self._call_position(e.index)
                if index is None or not e.fragment:
                    continue
                self._args[index].append(e.fragment)
                prev = last["tool_calls"][0] if last is not None and "tool_calls" in last else None
                if prev is not None and prev["index"] == index and "id" not in prev:
                    prev["function"]["arguments"] += e.fragment
                else:
                    deltas.append({"tool_calls": [{"index": index, "function": {"arguments": e.fragment}}]})
        return deltas

    def _call_position(self, parser_index: int) -> int | None:
        # Parsers number calls from 0 in order, as this list does: the same position.
        return parser_index if parser_index < len(self._calls) else None
