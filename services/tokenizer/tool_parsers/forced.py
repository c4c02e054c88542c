"""The answers of `tool_choice` "required" and a named function: structured outputs make the model
write JSON (see http/tool_choice.py for the schemas), read here as tool calls.

Named function: the whole answer is that function's arguments object. Required: the answer is an
array of `{"name": ..., "parameters": {...}}` calls.
"""

from __future__ import annotations

from himamba.services.tokenizer.tool_parsers.events import Event, Text, ToolArgs, ToolStart
from himamba.services.tokenizer.tool_parsers.json_calls import JsonCallScanner


class NamedCall:
    """The whole answer is the arguments of one call to `name`: announced before the first text."""

    def __init__(self, name: str):
        self._name = name
        self._started = False

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        if not self._started:
            self._started = True
            out.append(ToolStart(0, self._name))
        if text:
            out.append(ToolArgs(0, text))
        return out

    def finish(self) -> list[Event]:
        return [] if self._started else [ToolStart(0, self._name), ToolArgs(0, "")]


class RequiredCalls:
    """The whole answer is a JSON array of calls; text the scan cannot read is content (which the
    grammar makes impossible unless the answer was cut short).

    Each call is held back until its object closes, then sent whole: an answer cut short by
    max_tokens (finish "length") carries the calls it completed and never one whose arguments
    are not valid JSON."""

    def __init__(self) -> None:
        self._scanner = JsonCallScanner()
        self._sent_error = False
        self._held: list[Event] = []  # the events of the call not closed yet

    def feed(self, text: str) -> list[Event]:
        events = self._held + self._scanner.feed(text)
        done = self._scanner.next_index  # calls below this index have closed
        out = [e for e in events if not isinstance(e, (ToolStart, ToolArgs)) or e.index < done]
        self._held = [e for e in events if isinstance(e, (ToolStart, ToolArgs)) and e.index >= done]
        if self._scanner.error_at is not None:
            self._held = []
            if not self._sent_error:
                self._sent_error = True
                out.append(Text(self._scanner.text_from(self._scanner.error_at)))
            elif text:
                out.append(Text(text))
        return out

    def finish(self) -> list[Event]:
        self._held = []  # a call cut short is dropped
        return []
