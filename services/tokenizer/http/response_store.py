"""The stored responses of /v1/responses (`store: true`): bounded by a count and a byte budget,
least recently used dropped first, and by an age (from the response's `created_at`, the clock
every server of a fleet shares, so a shared record expires everywhere at once). Owned by the HTTP front door; lost on restart, as its cache is.

A stored response keeps its Response object (for GET) and its input items (after any previous
response's input and output): with its output, the conversation that the next turn's
`previous_response_id` continues. A finished one also keeps the token ids its turn ran on
(responses_continuation.py), which the next turn extends.

`encode_record` / `decode_record`: one stored response as the bytes the fleet's shared store keeps
(shared_responses.py): everything GET, input_items and a continuation need, with the model that
made it (its token ids mean nothing to another model).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, NamedTuple

import msgspec

from himamba.services.tokenizer.http.responses_continuation import StoredTokens


class StoredResponse(NamedTuple):
    """One kept response: the Response object and the items that were its input."""

    response: dict[str, Any]
    inputs: list[dict[str, Any]]
    size: int  # bytes of all it keeps, as JSON: what the budget counts
    tokens: StoredTokens | None = None  # the turn's token ids (a finished response)

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """Its input then its output: what a next turn continues."""
        return [*self.inputs, *self.response["output"]]


class _Record(msgspec.Struct, forbid_unknown_fields=False):
    """A stored response in the shared store (JSON)."""

    model: str
    response: dict[str, Any]
    inputs: list[dict[str, Any]]
    tokens: StoredTokens | None = None


def encode_record(model: str, found: StoredResponse) -> bytes:
    return msgspec.json.encode(_Record(model, found.response, found.inputs, found.tokens))


class DecodedRecord(NamedTuple):
    """A record read back: the model that made it and the response."""

    model: str
    stored: StoredResponse


def decode_record(data: bytes) -> DecodedRecord:
    """The record's response; msgspec.DecodeError (a ValueError) when it is not one."""
    rec = msgspec.json.decode(data, type=_Record)
    return DecodedRecord(rec.model, StoredResponse(rec.response, rec.inputs, len(data), rec.tokens))


def expired(response: dict[str, Any], max_age_s: int, now: float | None = None) -> bool:
    """Whether a response is past `max_age_s` (0: never); one without `created_at` never is."""
    created = response.get("created_at")
    if max_age_s <= 0 or not isinstance(created, (int, float)):
        return False
    return (time.time() if now is None else now) - created > max_age_s


class ResponseStore:
    """An LRU map from response id to `StoredResponse`, within `max_count`, `max_bytes` and
    `max_age_s`. An expired response is dropped when it is next looked up (until then it is just
    an entry the count and byte bounds push out like any other)."""

    def __init__(self, max_count: int, max_bytes: int, max_age_s: int = 0):
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._kept)

    def put(
        self,
        response_id: str,
        response: dict[str, Any],
        inputs: list[dict[str, Any]],
        tokens: StoredTokens | None = None,
    ) -> bool:
        """Keep a response (dropping the least recently used to make room); False when it
        cannot be kept at all (no room, or larger than the whole budget)."""
        size = len(msgspec.json.encode(response)) + len(msgspec.json.encode(inputs))
        if tokens is not None:
            size += len(msgspec.json.encode(tokens))
        if self.max_count == 0 or size > self.max_bytes:
            return False
        self.delete(response_id)
        while self._kept and (len(self._kept) >= self.max_count or self.bytes + size > self.max_bytes):
            _, dropped = self._kept.popitem(last=False)
            self.bytes -= dropped.size
        self._kept[response_id] = StoredResponse(response, inputs, size, tokens)
        self.bytes += size
        return True

    def get(self, response_id: str, now: float | None = None) -> StoredResponse | None:
        """The kept response (now the most recently used), or None (also when it has expired:
        then it is dropped)."""
        found = self._kept.get(response_id)
        if found is None:
            return None
        if expired(found.response, self.max_age_s, now):
            self.delete(response_id)
            return None
        self._kept.move_to_end(response_id)
        return found

    def delete(self, response_id: str) -> bool:
        """Forget a response; False when it was not kept."""
        found = self._kept.pop(response_id, None)
        if found is None:
            return False
        self.bytes -= found.size
        return True
