"""What a streaming output parser says about the text it is fed: content, reasoning, tool calls.

Every parser (tool calls, reasoning) is fed text deltas and answers with a list of these events;
fed the whole text at once it answers the same events, merged. A tool call is announced once
(`ToolStart`, with its name) and its arguments then arrive as `ToolArgs` fragments whose
concatenation is the arguments' JSON text.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol


class Text(NamedTuple):
    """Plain answer text (`content`)."""

    text: str


class Reasoning(NamedTuple):
    """Thinking text (`reasoning_content`)."""

    text: str


class ToolStart(NamedTuple):
    """A tool call begins: the `index`-th call of this answer, to function `name`."""

    index: int
    name: str


class ToolArgs(NamedTuple):
    """A piece of the `index`-th call's arguments (JSON text)."""

    index: int
    fragment: str


Event = Text | Reasoning | ToolStart | ToolArgs


class StreamParser(Protocol):
    """Fed text deltas in order; `finish` once at the end of the answer."""

    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


def held_prefix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (kept back until
    the next delta says whether the marker follows)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
