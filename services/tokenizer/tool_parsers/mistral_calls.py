"""Mistral's tool calls, after the `[TOOL_CALLS]` token (vLLM's `mistral`), in either of the two
shapes its tokenizers teach:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]    (v3: a JSON list)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[ARGS]{}      (v11 and later)

The first is json_calls.py's. The second is scanned here: the call is announced when `[ARGS]`
ends its name (a `[CALL_ID]...` between them is skipped), and its arguments object streams as it
is written, up to the brace that closes it. Mistral's templates refuse tool-call ids that are not
9 letters or digits when the conversation comes back: `call_id` makes ids of that shape.
"""

from __future__ import annotations

import re
import secrets
import string

from himamba.services.tokenizer.tool_parsers.events import Event, ToolArgs, ToolStart
from himamba.services.tokenizer.tool_parsers.json_calls import JsonCallScanner

ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_WS = " \t\r\n"
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_ID_CHARS = string.ascii_letters + string.digits


def call_id() -> str:
    """A tool-call id as Mistral's templates require: 9 letters or digits."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


class MistralCallScanner:
    """The inside of one `[TOOL_CALLS]` block: a JSON list (or object) of calls, or `name[ARGS]{...}`."""

    def __init__(self, first_index: int):
        self._first = first_index
        self._inner: JsonCallScanner | NameArgsScanner | None = None
        self._pending = ""  # leading whitespace, until the first character picks the shape

    @property
    def text(self) -> str:
        return self._pending if self._inner is None else self._pending + self._inner.text

    @property
    def error_at(self) -> int | None:
        if self._inner is None or self._inner.error_at is None:
            return None
        return len(self._pending) + self._inner.error_at

    @property
    def next_index(self) -> int:
        return self._first if self._inner is None else self._inner.next_index

    def text_from(self, pos: int) -> str:
        return self.text[pos:]

    def feed(self, text: str) -> list[Event]:
        if self._inner is None:
            body = (self._pending + text).lstrip(_WS)
            if not body:
                self._pending += text
                return []
            ws = len(self._pending) + len(text) - len(body)
            self._pending = (self._pending + text)[:ws]
            self._inner = JsonCallScanner(self._first) if body[0] in "[{" else NameArgsScanner(self._first)
            text = body
        return self._inner.feed(text)


class NameArgsScanner:
    """`name[ARGS]{...}` (one call: the next one has a `[TOOL_CALLS]` of its own)."""

    def __init__(self, first_index: int):
        self.text = ""
        self.error_at: int | None = None
        self.next_index = first_index
        self._state = "name"  # name, args, object, after
        self._pos = 0
        self._depth = 0
        self._in_str = False
        self._esc = False

    def text_from(self, pos: int) -> str:
        return self.text[pos:]

    def feed(self, text: str) -> list[Event]:
        start = len(self.text)
        self.text += text
        out: list[Event] = []
        if self.error_at is not None:
            return out
        if self._state == "name":
            self._read_name(out)
        if self._state in ("args", "object"):
            self._read_object(max(start, self._pos), out)
        elif self._state == "after" and self.text[self._pos :].strip(_WS):
            self.error_at = self._pos + len(self.text[self._pos :]) - len(self.text[self._pos :].lstrip(_WS))
        return out

    def _read_name(self, out: list[Event]) -> None:
        head = self.text.lstrip(_WS)
        bracket = head.find("[")
        name = (head if bracket < 0 else head[:bracket]).strip(_WS)
        if name and not _NAME.fullmatch(name):
            self.error_at = 0  # not a name: not this format
            return
        if bracket < 0:
            return
        rest = head[bracket:]
        if rest.startswith(CALL_ID):
            k = rest.find(ARGS, len(CALL_ID))
        elif rest.startswith(ARGS):
            k = 0
        else:
            if not (ARGS.startswith(rest) or CALL_ID.startswith(rest)):
                self.error_at = 0
            return
        if k < 0:
            return
        if not name:
            self.error_at = 0
            return
        out.append(ToolStart(self.next_index, name))
        self._state = "args"
        self._pos = len(self.text) - len(head) + bracket + k + len(ARGS)

    def _read_object(self, start: int, out: list[Event]) -> None:
        text = self.text
        i = self._pos
        sent_from = max(start, self._pos)
        while i < len(text):
            c = text[i]
            if self._state == "args":
                if c in _WS:
                    i += 1
                    sent_from = i
                    continue
                if c != "{":
                    self.error_at = i
                    self._pos = i
                    return
                self._state, self._depth, sent_from = "object", 1, i
            elif self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
            elif c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    out.append(ToolArgs(self.next_index, text[sent_from : i + 1]))
                    self.next_index += 1
                    self._state, self._pos = "after", i + 1
                    rest = text[i + 1 :]
                    if rest.strip(_WS):
                        self.error_at = i + 1 + len(rest) - len(rest.lstrip(_WS))
                    return
            i += 1
        if self._state == "object" and sent_from < len(text):
            out.append(ToolArgs(self.next_index, text[sent_from:]))
        self._pos = len(text)
