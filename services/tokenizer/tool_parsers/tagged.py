"""Content with tool-call blocks between a start and an end tag (`<tool_call>...</tool_call>`,
`<TOOLCALL>...</TOOLCALL>`), or after a start tag alone (`[TOOL_CALLS]`: the block runs to the
next start tag or the end of the answer), parsed as it streams.

Outside a block the text is content; a possible start of a tag is held back until the next delta
settles it. Inside a block a scanner (JSON or XML) turns the text into tool-call events. A block
the scanner cannot read before it announced anything goes back to the content whole, tags
included; after that, the unreadable rest of the block is content. The same rules apply however
the text is split, so a streamed answer and a whole one parse to the same thing.

Whitespace around blocks is not content: trailing whitespace is held back and dropped when a
block follows (or at the end, when the answer called a tool).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from himamba.services.tokenizer.tool_parsers.events import Event, Text, ToolStart, held_prefix


class BlockScanner(Protocol):
    """Reads the inside of one block. `text` is all it was fed (read only while it announced no
    call); `text_from(pos)` the text from a position on."""

    text: str
    error_at: int | None

    def text_from(self, pos: int) -> str: ...

    def feed(self, text: str) -> list[Event]: ...


class TaggedCalls:
    """A StreamParser for tool calls inside `start` ... `end` blocks."""

    def __init__(self, start: str, end: str | None, make_scanner: Callable[[int], BlockScanner]):
        self._start = start
        self._end = end
        self._make = make_scanner
        self._pending = ""  # text not yet settled (a possible tag, or not yet fed to the scanner)
        self._ws = ""  # trailing whitespace of the content, held back
        self._block_ws = ""  # the whitespace before the current block: content again if it is text
        self._scanner: BlockScanner | None = None  # inside a block
        self._committed = False  # the current block announced a call
        self._failed = False  # the current block's scanner gave up: its rest is content
        self._calls = 0

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._pending += text
        while True:
            if self._scanner is None:
                k = self._pending.find(self._start)
                if k < 0:
                    keep = held_prefix(self._pending, self._start)
                    self._content(self._pending[: len(self._pending) - keep], out)
                    self._pending = self._pending[len(self._pending) - keep :]
                    return out
                self._content(self._pending[:k], out)
                self._block_ws, self._ws = self._ws, ""  # whitespace before a block is not content
                self._pending = self._pending[k + len(self._start) :]
                self._scanner = self._make(self._calls)
                self._committed = self._failed = False
            else:
                end = self._start if self._end is None else self._end
                k = self._pending.find(end)
                if k < 0:
                    keep = held_prefix(self._pending, end)
                    self._inside(self._pending[: len(self._pending) - keep], out)
                    self._pending = self._pending[len(self._pending) - keep :]
                    return out
                self._inside(self._pending[:k], out)
                if self._end is None:  # the next block's start tag: left for the next turn of the loop
                    self._pending = self._pending[k:]
                    self._close_block("", out)
                else:
                    self._pending = self._pending[k + len(self._end) :]
                    self._close_block(self._end, out)

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._scanner is not None:
            self._inside(self._pending, out)
            self._pending = ""
            self._close_block("", out)
        else:
            self._content(self._pending, out)
            self._pending = ""
        if self._ws and not self._calls:
            out.append(Text(self._ws))
        self._ws = ""
        return out

    def _content(self, text: str, out: list[Event]) -> None:
        text = self._ws + text
        body = len(text.rstrip())
        if body:
            out.append(Text(text[:body]))
        self._ws = text[body:]

    def _inside(self, text: str, out: list[Event]) -> None:
        scanner = self._scanner
        assert scanner is not None
        if self._failed:
            self._content(text, out)
            return
        events = scanner.feed(text)
        started = sum(isinstance(e, ToolStart) for e in events)
        self._calls += started  # calls are numbered across blocks, closed or not
        if started and not self._committed:
            self._committed = True
            self._block_ws = ""
        out.extend(events)
        if scanner.error_at is not None:
            self._failed = True
            if self._committed:
                self._content(scanner.text_from(scanner.error_at), out)
            else:
                self._content(self._block_ws + self._start + scanner.text, out)

    def _close_block(self, end_tag: str, out: list[Event]) -> None:
        scanner = self._scanner
        assert scanner is not None
        if self._failed:
            self._content(end_tag, out)
        elif not self._committed:  # nothing in it was a call: it was text
            self._content(self._block_ws + self._start + scanner.text + end_tag, out)
        self._scanner = None
