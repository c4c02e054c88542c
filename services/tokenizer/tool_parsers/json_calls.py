"""Tool calls written as JSON: `{"name": ..., "arguments": {...}}` objects, alone, one after the
other, or in an array — scanned as they arrive.

A call is announced (`ToolStart`) as soon as its name string is complete; when its arguments
object follows the name, its characters are streamed (`ToolArgs`) as they come, up to the brace
that closes it, so the fragments join to the arguments exactly as the model wrote them. Arguments
that come before the name, or as a JSON string, go out whole when the call's object closes.
The scan is one pass over the new characters only, never rereading old text (per-delta work is
proportional to the delta, however long the call).

Text that cannot be tool calls stops the scan: `error_at` says where, and the owner decides what
becomes of the rest (content). A call already announced stays announced.
"""

from __future__ import annotations

import json
from typing import Any

from himamba.services.tokenizer.tool_parsers.events import Event, ToolArgs, ToolStart

_WS = " \t\r\n"
ARGS_KEYS = ("arguments", "parameters")  # Nemotron and Hermes write "arguments"; vLLM's schemas "parameters"


class JsonCallScanner:
    """Scans the JSON text of tool calls; calls are numbered from `first_index`."""

    def __init__(self, first_index: int = 0, separators: str = ","):
        self._chunks: list[str] = []  # everything fed so far (joined only when `text` is read)
        self._size = 0
        self._piece = ""  # the text being scanned, from `_piece_start`
        self._piece_start = 0
        self._capture: list[str] | None = None  # the raw characters of the key or value being read
        self.error_at: int | None = None
        self.next_index = first_index  # the index the next call will have
        self._separators = separators  # between top-level calls (Llama 3 writes "; ")
        self._depth = 0
        self._base: int | None = None  # depth at which call objects open: 0, or 1 inside an array
        self._array_closed = False
        self._in_str = False
        self._esc = False
        self._str_role = ""  # "key" / "value" for strings at call level, "" deeper
        # the call being scanned
        self._obj_start = -1
        self._expect = ""  # key, colon, value, literal, nested, after
        self._key: str | None = None
        self._name: str | None = None
        self._announced = False
        self._args_text: str | None = None
        self._args_streamed = False
        self._stream_from: int | None = None  # arguments characters from here on not sent yet

    @property
    def text(self) -> str:
        """Everything fed so far (joined on demand: the scan itself never rereads old text)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def text_from(self, pos: int) -> str:
        return self.text[pos:]

    def feed(self, text: str) -> list[Event]:
        """Scan `text` (the next characters); the events it completes."""
        self._chunks.append(text)
        self._piece, self._piece_start = text, self._size
        self._size += len(text)
        out: list[Event] = []
        if self.error_at is not None:
            return out
        i = self._piece_start
        for c in text:
            if self._capture is not None:
                self._capture.append(c)
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
                    self._string_end(i, out)
            elif self._base is not None and self._depth == self._base + 1:
                self._call_level_char(i, c, out)
            elif self._base is not None and self._depth > self._base + 1:
                self._nested_char(i, c, out)
            else:
                self._top_level_char(i, c)
            if self.error_at is not None:
                return out
            i += 1
        if self._stream_from is not None and i > self._stream_from:
            out.append(ToolArgs(self.next_index, self._recent(self._stream_from, i)))
            self._stream_from = i
        return out

    def _recent(self, start: int, end: int) -> str:
        """Text of the piece being scanned (streamed arguments never reach further back)."""
        assert start >= self._piece_start, "streamed arguments start in the piece being scanned"
        return self._piece[start - self._piece_start : end - self._piece_start]

    # ------------------------------------------------------------ levels

    def _top_level_char(self, i: int, c: str) -> None:
        if c in _WS or c in self._separators:
            return
        if self._array_closed:
            self._fail(i)
        elif c == "[" and self._base is None:
            self._base = 1
            self._depth = 1
        elif c == "{" and self._depth == (self._base or 0):
            if self._base is None:
                self._base = 0
            self._depth += 1
            self._open_call(i)
        elif c == "]" and self._base == 1 and self._depth == 1:
            self._depth = 0
            self._array_closed = True
        else:
            self._fail(i)

    def _call_level_char(self, i: int, c: str, out: list[Event]) -> None:
        expect = self._expect
        if c in _WS:
            if expect == "literal":
                self._value_end(i, out, i)
            return
        if expect == "literal" and c in ",}":
            self._value_end(i, out, i)
            expect = self._expect
        if c == '"':
            if expect == "key":
                self._str_role = "key"
                self._capture = [c]
            elif expect == "value":
                self._str_role = "value"
                self._capture_value(c)
            else:
                return self._fail(i)
            self._in_str = True
        elif c == ":":
            if expect != "colon":
                return self._fail(i)
            self._expect = "value"
        elif c == ",":
            if expect != "after":
                return self._fail(i)
            self._expect = "key"
        elif c in "{[":
            if expect != "value":
                return self._fail(i)
            self._depth += 1
            self._expect = "nested"
            if c == "{" and self._key in ARGS_KEYS and self._announced and not self._args_streamed:
                self._stream_from = i
            else:
                self._capture_value(c)
        elif c == "}":
            if expect not in ("key", "after"):
                return self._fail(i)
            self._depth -= 1
            self._close_call(i, out)
        elif expect == "value":
            self._expect = "literal"
            self._capture_value(c)
        elif expect != "literal":
            self._fail(i)

    def _nested_char(self, i: int, c: str, out: list[Event]) -> None:
        if c == '"':
            self._in_str = True
            self._str_role = ""
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            if self._depth == (self._base or 0) + 1:
                self._value_end(i + 1, out, i)

    # ------------------------------------------------------------ call state

    def _open_call(self, i: int) -> None:
        self._obj_start = i
        self._expect = "key"
        self._key = None
        self._name = None
        self._announced = False
        self._args_text = None
        self._args_streamed = False
        self._stream_from = None

    def _capture_value(self, c: str) -> None:
        # Only the name and arguments not streamed are kept (their size is the value's own).
        if self._key == "name" or self._key in ARGS_KEYS:
            self._capture = [c]

    def _captured(self, end: int, i: int) -> str:
        """The captured characters up to `end` (exclusive); `i` is the character just read."""
        chars, self._capture = self._capture or [], None
        return "".join(chars[: len(chars) - (i + 1 - end)])

    def _string_end(self, i: int, out: list[Event]) -> None:
        role, self._str_role = self._str_role, ""
        if role == "key":
            key = _loads(self._captured(i + 1, i))
            self._key = key if isinstance(key, str) else None
            self._expect = "colon"
        elif role == "value":
            self._value_end(i + 1, out, i)

    def _value_end(self, end: int, out: list[Event], i: int) -> None:
        self._expect = "after"
        text = self._captured(end, i)
        if self._key == "name" and not self._announced:
            name = _loads(text)
            if isinstance(name, str) and name and self._args_text is None:
                self._name = name
                self._announced = True
                out.append(ToolStart(self.next_index, name))
            elif isinstance(name, str):
                self._name = name  # arguments came first: announced when the object closes
        elif self._key in ARGS_KEYS:
            if self._stream_from is not None:
                if end > self._stream_from:
                    out.append(ToolArgs(self.next_index, self._recent(self._stream_from, end)))
                self._stream_from = None
                self._args_streamed = True
            elif not self._args_streamed:
                self._args_text = text

    def _close_call(self, i: int, out: list[Event]) -> None:
        start, self._obj_start = self._obj_start, -1
        if not self._announced:
            obj = _loads(self.text[start : i + 1])
            wrapped = obj.get("function") if isinstance(obj, dict) else None
            if isinstance(wrapped, dict) and self._name is None:
                # OpenAI's own shape, which templates that render history with tojson teach
                # (Falcon-H1): {"id", "type": "function", "function": {"name", "arguments"}}.
                self._name = wrapped.get("name")
                args = wrapped.get("arguments", wrapped.get("parameters"))
                self._args_text = None if args is None else json.dumps(args, ensure_ascii=False)
            if not (isinstance(obj, dict) and isinstance(self._name, str) and self._name):
                self._fail(start)  # not a call: the owner turns it back into text
                return
            self._announced = True
            out.append(ToolStart(self.next_index, self._name))
        if not self._args_streamed:
            out.append(ToolArgs(self.next_index, _arguments_json(self._args_text)))
        self.next_index += 1

    def _fail(self, i: int) -> None:
        self.error_at = i
        self._stream_from = None


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _arguments_json(text: str | None) -> str:
    """The arguments' JSON text: as written, or unwrapped when the model wrote them as a JSON string."""
    if text is None:
        return "{}"
    if text.startswith('"'):
        inner = _loads(text)
        return inner if isinstance(inner, str) else text
    return text
