"""Answers that are tool calls from their first character, or plain text: the formats without
tags around the calls (Llama 3's JSON, Granite 3's list, the pythonic list), parsed as they stream.

The answer may open with whitespace and one of the format's prefix tokens (`<|python_tag|>`,
`<|tool_call|>`); what follows goes to the format's scanner. If the scanner cannot read it before
it announced a call, the whole answer is content (a model that answered in prose); after a
call, the unreadable rest is content, as in tagged.py. Text that may still become the prefix is
held back until the next delta settles it, so a streamed answer parses as the whole one does.
"""

from __future__ import annotations

from collections.abc import Callable

from himamba.services.tokenizer.tool_parsers.events import Event, Text, ToolStart
from himamba.services.tokenizer.tool_parsers.tagged import BlockScanner


class LeadingCalls:
    """A StreamParser for answers that are calls read by `make_scanner(0)` after an optional prefix."""

    def __init__(self, prefixes: tuple[str, ...], make_scanner: Callable[[int], BlockScanner]):
        self._prefixes = prefixes
        self._make = make_scanner
        self._head = ""  # the answer's start, while it may still be whitespace or a prefix
        self._offset = 0  # where in the head the scanner's text begins
        self._scanner: BlockScanner | None = None
        self._content = False  # the answer is text from here on
        self._committed = False  # a call was announced

    def feed(self, text: str) -> list[Event]:
        if self._content:
            return [Text(text)] if text else []
        if self._scanner is not None:
            return self._scan(text)
        self._head += text
        start = self._start_of_calls()
        if start is None:
            return []
        self._offset = start
        self._scanner = self._make(0)
        return self._scan(self._head[start:])

    def finish(self) -> list[Event]:
        if self._content or self._committed:
            return []
        self._content = True
        # Only whitespace or part of a prefix, or calls cut short before the first was announced: text.
        text = self._head if self._scanner is None else self._head[: self._offset] + self._scanner.text
        return [Text(text)] if text else []

    def _start_of_calls(self) -> int | None:
        """Where the scanner's text begins in the head; None while that is not settled."""
        body = self._head.lstrip()
        if not body:
            return None
        skipped = len(self._head) - len(body)
        for prefix in self._prefixes:
            if body.startswith(prefix):
                return skipped + len(prefix)
            if prefix.startswith(body):
                return None  # the prefix may be arriving
        return skipped

    def _scan(self, text: str) -> list[Event]:
        scanner = self._scanner
        assert scanner is not None
        events = scanner.feed(text)
        self._committed = self._committed or any(isinstance(e, ToolStart) for e in events)
        if scanner.error_at is None:
            return events
        self._content = True
        if self._committed:
            rest = scanner.text_from(scanner.error_at)
            return [*events, Text(rest)] if rest else events
        return [Text(self._head[: self._offset] + scanner.text)]
