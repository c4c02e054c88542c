"""Tool calls in the XML style of Qwen3-Coder and Nemotron 3:

    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>

(the inside of a `<tool_call>` block). Parameter values are text; each is converted to the JSON
type the tool's schema gives it (a string stays a string, `3` becomes 3 for an integer, an
object is parsed), and without a schema JSON-looking values are parsed. The call is announced
at `<function=name>`; a string parameter streams as it is written (a file's contents, say), any
other goes out when its `</parameter>` arrives, and `</function>` closes the object: the
fragments join to `json.dumps(arguments)`.
"""

from __future__ import annotations

import json
from typing import Any

from himamba.services.tokenizer.tool_parsers.events import Event, ToolArgs, ToolStart

_FUNCTION = "<function="
_FUNCTION_END = "</function>"
_PARAMETER = "<parameter="
_PARAMETER_END = "</parameter>"
_WS = " \t\r\n"
_TRIM_STEP = 4096  # characters behind the scan kept at most before they are dropped


class XmlCallScanner:
    """Scans the inside of a tool-call block written in the XML style; `tools` (the request's)
    give the parameters' types.

    Positions are offsets into everything fed; once a call is announced, the text behind the
    scan is dropped, so a long streamed string value costs each delta only its own length."""

    def __init__(self, first_index: int, tools: list[dict[str, Any]] | None):
        self._buf = ""  # the text fed, from `_offset` on
        self._offset = 0
        self.error_at: int | None = None
        self.next_index = first_index
        self._tools = tools or []
        self._pos = 0
        self._state = "function"  # function, name, params, pname, value
        self._name = ""
        self._params = 0  # parameters sent for the current call
        self._pname = ""
        self._value_start = 0
        self._search_from = 0
        self._is_string = False  # the current value is a string (by the schema): streamed as it comes
        self._emit_from = 0  # its characters from here on not sent yet
        self._opened = False  # its key and opening quote were sent
        self._announced = False  # a call was announced: the text behind the scan may go

    @property
    def text(self) -> str:
        """The text fed, while no call was announced (the owner's fallback: it was all text)."""
        assert self._offset == 0, "text behind an announced call is dropped"
        return self._buf

    def text_from(self, pos: int) -> str:
        return self._buf[pos - self._offset :]

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while self.error_at is None and self._step(out):
            pass
        if self._announced and self.error_at is None:
            self._trim()
        return out

    def _trim(self) -> None:
        """Drop the text behind every position still in use (in large steps: copies stay rare)."""
        keep = self._pos
        if self._state == "value":
            keep = min(self._search_from, self._emit_from if self._is_string else self._value_start)
        if keep - self._offset > _TRIM_STEP:
            self._buf = self._buf[keep - self._offset :]
            self._offset = keep

    def _at(self, pos: int) -> str:
        return self._buf[pos - self._offset]

    def _slice(self, start: int, end: int) -> str:
        return self._buf[start - self._offset : end - self._offset]

    def _find(self, marker: str, start: int) -> int:
        k = self._buf.find(marker, start - self._offset)
        return k if k < 0 else k + self._offset

    def _step(self, out: list[Event]) -> bool:
        """One move of the state machine; False when it needs more text."""
        size = self._offset + len(self._buf)
        pos = self._pos
        if self._state in ("function", "params"):
            while pos < size and self._at(pos) in _WS:
                pos += 1
            self._pos = pos
            rest = self._slice(pos, min(size, pos + len(_FUNCTION_END) + 1))
            if not rest:
                return False
            markers = (_FUNCTION,) if self._state == "function" else (_PARAMETER, _FUNCTION_END)
            for marker in markers:
                if rest.startswith(marker):
                    self._pos = pos + len(marker)
                    self._on_marker(marker, out)
                    return True
            if any(marker.startswith(rest) for marker in markers):
                return False  # a marker may be arriving
            self.error_at = pos
            return False
        if self._state in ("name", "pname"):
            k = self._find(">", pos)
            if k < 0:
                return False
            value = self._slice(pos, k).strip()
            self._pos = k + 1
            if self._state == "name":
                if not value:
                    self.error_at = pos
                    return False
                self._name, self._params, self._state = value, 0, "params"
                self._announced = True
                out.append(ToolStart(self.next_index, value))
            else:
                self._pname, self._state = value, "value"
                self._value_start = self._search_from = self._emit_from = self._pos
                self._opened = False
                types = _parameter_type(self._tools, self._name, value)
                self._is_string = "string" in (types if isinstance(types, list) else [types])
            return True
        # value: up to </parameter> (or a </function> that closes it early)
        end = self._find(_PARAMETER_END, self._search_from)
        cut = self._find(_FUNCTION_END, self._search_from)
        if end < 0 and cut < 0:
            self._search_from = max(self._value_start, size - len(_PARAMETER_END) + 1)
            if self._is_string:
                self._stream_string(size, out)
            return False
        stop = end if end >= 0 and (cut < 0 or end < cut) else cut
        self._pos = stop + len(_PARAMETER_END) if stop == end else stop
        if self._is_string:
            self._end_string(stop, out)
        else:
            self._send_parameter(self._slice(self._value_start, stop), out)
        self._state = "params"
        return True

    def _value_head(self) -> str:
        head = "{" if self._params == 0 else ", "
        self._params += 1
        return f"{head}{json.dumps(self._pname, ensure_ascii=False)}: "

    def _stream_string(self, size: int, out: list[Event]) -> None:
        """Send a string value's settled characters now (a long one, code say, streams as it is
        written): all but the last few, which may be the newline and tag that end it."""
        if self._emit_from == self._value_start:
            if size == self._value_start:
                return
            if self._at(self._value_start) == "\n":  # the one newline after the tag is not the value's
                self._emit_from += 1
        limit = size - len(_PARAMETER_END)
        if limit <= self._emit_from:
            return
        piece = self._slice(self._emit_from, limit)
        self._emit_from = limit
        head = "" if self._opened else self._value_head() + '"'
        self._opened = True
        out.append(ToolArgs(self.next_index, head + json.dumps(piece, ensure_ascii=False)[1:-1]))

    def _end_string(self, stop: int, out: list[Event]) -> None:
        start = self._emit_from
        if start == self._value_start and start < stop and self._at(start) == "\n":
            start += 1  # the newline after the tag, not yet seen by _stream_string
        end = stop - 1 if stop - 1 >= start and self._at(stop - 1) == "\n" else stop
        piece = self._slice(start, end)
        head = "" if self._opened else self._value_head() + '"'
        self._opened = True
        out.append(ToolArgs(self.next_index, head + json.dumps(piece, ensure_ascii=False)[1:-1] + '"'))

    def _on_marker(self, marker: str, out: list[Event]) -> None:
        if marker == _FUNCTION:
            self._state = "name"
        elif marker == _PARAMETER:
            self._state = "pname"
        else:  # </function>
            out.append(ToolArgs(self.next_index, "}" if self._params else "{}"))
            self.next_index += 1
            self._state = "function"

    def _send_parameter(self, raw: str, out: list[Event]) -> None:
        raw = raw.removeprefix("\n").removesuffix("\n")
        value = convert_parameter(raw, _parameter_type(self._tools, self._name, self._pname))
        out.append(ToolArgs(self.next_index, self._value_head() + json.dumps(value, ensure_ascii=False)))


def _parameter_type(tools: list[dict[str, Any]], function: str, parameter: str) -> Any:
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and fn.get("name") == function:
            props = (fn.get("parameters") or {}).get("properties") or {}
            spec = props.get(parameter)
            return spec.get("type") if isinstance(spec, dict) else None
    return None


def convert_parameter(raw: str, json_type: Any) -> Any:
    """A parameter's text as the JSON value its schema type says (the text itself when it does not fit)."""
    types = json_type if isinstance(json_type, list) else [json_type]
    if "string" in types:
        return raw
    text = raw.strip()
    if text == "null" and ("null" in types or None in types):
        return None
    for t in types:
        if t == "integer":
            try:
                return int(text)
            except ValueError:
                pass
        elif t == "number":
            try:
                number = float(text)
                return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number
            except ValueError:
                pass
        elif t == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        elif t in ("object", "array", None):
            try:
                return json.loads(text)
            except ValueError:
                pass
    return raw
