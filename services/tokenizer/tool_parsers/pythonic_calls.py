"""Tool calls written as a Python list of calls with keyword arguments (vLLM's `pythonic`: Llama
3.2's and ToolACE's format):

    [get_weather(city="Paris", days=3), now()]

Scanned as it arrives: a call is sent (`ToolStart` and its arguments as one JSON object) when its
closing parenthesis comes, its arguments read as Python literals (strings, numbers, True/False/
None, lists, dicts, tuples) by `ast`, never evaluated. Anything else (positional arguments, an
expression, text after the list) stops the scan: `error_at` says where, as in json_calls.py.
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any

from himamba.services.tokenizer.tool_parsers.events import Event, ToolArgs, ToolStart

_WS = " \t\r\n"
_CLOSE = {"(": ")", "[": "]", "{": "}"}
_QUOTES = "\"'"


class PythonicCallScanner:
    """Scans `[name(k=v, ...), ...]`; calls are numbered from `first_index`."""

    def __init__(self, first_index: int = 0):
        self.text = ""  # everything fed (a call's text is kept until it closes: calls are short)
        self.error_at: int | None = None
        self.next_index = first_index
        self._pos = 0  # the next character to scan
        self._state = "open"  # open, call, args, after, done
        self._call_start = 0
        self._stack: list[str] = []  # the closing brackets expected inside the call
        self._quote = ""  # the quote of the string being read (one character, or three)
        self._body_at = 0  # where that string's closing quotes may begin: its text, then past each escape
        self._esc = False

    def text_from(self, pos: int) -> str:
        return self.text[pos:]

    def feed(self, text: str) -> list[Event]:
        self.text += text
        out: list[Event] = []
        while self.error_at is None and self._pos < len(self.text):
            i, c = self._pos, self.text[self._pos]
            if self._state == "args":
                if not self._args_char(i, c, out):
                    break  # a quote that may open a triple-quoted string: wait for the next text
                continue
            self._pos += 1
            if c in _WS:
                continue
            if self._state == "open":
                self._expect(c == "[", i, "call")
            elif self._state == "call":
                if c.isalpha() or c == "_":
                    self._call_start, self._state = i, "args"
                else:
                    self._fail(i)  # an empty list, or not a name, is not a call
            elif self._state == "after":
                if c == ",":
                    self._state = "call"
                else:
                    self._expect(c == "]", i, "done")
            else:  # done: nothing may follow the list
                self._fail(i)
        return out

    def _expect(self, ok: bool, i: int, state: str) -> None:
        if ok:
            self._state = state
        else:
            self._fail(i)

    def _fail(self, i: int) -> None:
        self.error_at = i

    def _args_char(self, i: int, c: str, out: list[Event]) -> bool:
        """Scan one character of `name(...)` (strings and brackets tracked until its parenthesis
        closes); False when it cannot be read before more text comes."""
        self._pos = i + 1
        if self._quote:
            if self._esc:
                self._esc = False
                self._body_at = i + 1  # an escaped quote is text: it cannot be one of the closing three
            elif c == "\\":
                self._esc = True
            elif (len(self._quote) == 1 and c == self._quote) or (
                len(self._quote) == 3 and i - 2 >= self._body_at and self.text[i - 2 : i + 1] == self._quote
            ):
                self._quote = ""
            return True
        if c in _QUOTES:
            ahead = self.text[i : i + 3]
            if len(ahead) < 3 and ahead == c * len(ahead):
                self._pos = i
                return False
            self._quote = ahead if ahead == c * 3 else c
            self._body_at = i + len(self._quote)
            self._pos = self._body_at
        elif c in _CLOSE:
            self._stack.append(_CLOSE[c])
        elif c in ")]}":
            if not self._stack or self._stack.pop() != c:
                self._fail(i)
            elif not self._stack:
                self._close_call(i, out)
        elif not self._stack and not (c.isalnum() or c in "_." or c in _WS):
            self._fail(i)  # a call's name is a (dotted) identifier followed by "("
        return True

    def _close_call(self, i: int, out: list[Event]) -> None:
        call = _parse_call(self.text[self._call_start : i + 1])
        if call is None:
            return self._fail(self._call_start)
        name, arguments = call
        out.append(ToolStart(self.next_index, name))
        out.append(ToolArgs(self.next_index, json.dumps(arguments, ensure_ascii=False)))
        self.next_index += 1
        self._state = "after"


def _parse_call(source: str) -> tuple[str, dict[str, Any]] | None:
    """(name, keyword arguments) of `name(k=v, ...)` with literal values; None if it is not one."""
    try:
        node = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
        return None
    arguments: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:  # **kwargs
            return None
        try:
            arguments[kw.arg] = _json_value(ast.literal_eval(kw.value))
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
    return node.func.id, arguments


def _json_value(value: Any) -> Any:
    """A Python literal as JSON (tuples and sets as lists; bytes and complex are not arguments)."""
    if isinstance(value, (tuple, list, set, frozenset)):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (bytes, complex)) or (isinstance(value, float) and not math.isfinite(value)):
        raise ValueError("not a JSON value")
    return value
