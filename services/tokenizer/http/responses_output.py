"""The output of one /v1/responses request: chat answer deltas in, Responses items and stream
events out.

The answer is read as a chat answer is (the same `AnswerShaper`: reasoning parser, then tool-call
parser), and its chat deltas become Responses output items: a `reasoning` item (reasoning_text),
a `message` item (one output_text part), a `function_call` item per call. Streamed, each item is
opened (`response.output_item.added`, for a message `response.content_part.added`), grown by
deltas (`response.output_text.delta`, `response.reasoning_text.delta`,
`response.function_call_arguments.delta`) and closed (`...done` events, then
`response.output_item.done`) when the next item begins or the answer ends. Every event carries
`sequence_number`. The non-streamed response is the same items, so the two always agree.
"""

from __future__ import annotations

import uuid
from typing import Any

from himamba.common.types import Usage


def item_id(prefix: str) -> str:
    """An id in OpenAI's shape (`msg_`, `fc_`, `rs_`, `resp_` and hex)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def responses_usage(usage: Usage, reasoning_tokens: int) -> dict[str, Any]:
    """Usage in the Responses shape, with our per-tier cached tokens as an extension."""
    cached = usage.cached_tokens
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": cached.total,
            "cached_tokens_by_tier": {"device": cached.device, "host": cached.host, "storage": cached.storage},
        },
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class ResponseOutput:
    """Items and events of one response, fed the chat deltas of its answer in order."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being written
        self._seq = 0
        self._calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its function_call item

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """One stream event, numbered."""
        out = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return out

    @property
    def reasoning_text(self) -> str:
        return "".join(part["text"] for item in self.items if item["type"] == "reasoning" for part in item["content"])

    def feed(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The events of these chat deltas (role-only and empty deltas say nothing)."""
        events: list[dict[str, Any]] = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                events += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
        return events

    def finish(self) -> list[dict[str, Any]]:
        """Close the last item; an answer with no item at all gets an empty message."""
        events = self._close()
        if not self.items:
            events += self._opened(self._new("message"))
            events += self._close()
        return events

    def _new(self, kind: str) -> dict[str, Any]:
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            return {"id": item_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": [part]}  # fmt: skip
        return {"id": item_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [],
                "content": [{"type": "reasoning_text", "text": ""}]}  # fmt: skip

    def _opened(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        self._open = item
        index = len(self.items) - 1
        shown = {**item, "content": []} if item["type"] == "message" else item
        events = [self.event("response.output_item.added", output_index=index, item=_copy(shown))]
        if item["type"] == "message":
            events.append(
                self.event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part={**item["content"][0], "text": ""},
                )
            )
        return events

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            events += self._opened(self._new(kind))
        item = self._open
        assert item is not None
        item["content"][0]["text"] += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(
            self.event(name, item_id=item["id"], output_index=len(self.items) - 1, content_index=0, delta=text, **extra)
        )
        return events

    def _call(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        fn = delta.get("function") or {}
        if "id" in delta:  # a new call: its head
            events += self._close()
            item = {"id": item_id("fc"), "type": "function_call", "status": "in_progress", "call_id": delta["id"],
                    "name": fn.get("name", ""), "arguments": ""}  # fmt: skip
            self._calls[delta["index"]] = item
            events += self._opened(item)
        item = self._calls.get(delta["index"])
        fragment = fn.get("arguments") or ""
        if item is not None and fragment:
            item["arguments"] += fragment
            index = self.items.index(item)
            events.append(
                self.event(
                    "response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=fragment
                )
            )
        return events

    def _close(self) -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        self._open = None
        item["status"] = "completed"
        index = len(self.items) - 1
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            common = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events.append(self.event("response.output_text.done", **common, text=part["text"], logprobs=[]))
            events.append(self.event("response.content_part.done", **common, part=_copy(part)))
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events.append(
                self.event(
                    "response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0, text=text
                )
            )
        else:
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        events.append(self.event("response.output_item.done", output_index=index, item=_copy(item)))
        return events


def _copy(obj: dict[str, Any]) -> dict[str, Any]:
    # Events are encoded as they are written; items keep growing after an event names them.
    return {k: ([dict(p) for p in v] if isinstance(v, list) else v) for k, v in obj.items()}
