"""GET /v1/responses/{id}/input_items: a stored response's input items, a page at a time, as
OpenAI lists them (typed, message text as content parts)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from himamba.services.tokenizer.http.errors import ApiError


def _listed(item: dict[str, Any]) -> dict[str, Any]:
    # As OpenAI lists them: typed, and message text as content parts.
    out = {"type": "message", **item} if "type" not in item else dict(item)
    if out["type"] == "message" and isinstance(out.get("content"), str):
        part = "output_text" if out.get("role") == "assistant" else "input_text"
        out["content"] = [{"type": part, "text": out["content"]}]
    return out


_PAGE_LIMIT = 100


def item_page(items: list[dict[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
    """One page of `items` as OpenAI's list: `order` asc/desc (default), `limit` 1..100 (default
    20), `after` the id of the item before the page; a 400 naming a bad parameter."""
    unknown = sorted(set(query) - {"order", "limit", "after", "include"})
    if unknown:
        raise ApiError(400, f"Unrecognized query parameter: {unknown[0]}", param=unknown[0])
    if query.get("include"):
        raise ApiError(400, "include is not supported: no extra item data is available", param="include")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order must be asc or desc, got {order!r}", param="order")
    limit_text = query.get("limit", "20")
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= _PAGE_LIMIT:
        raise ApiError(400, f"limit must be an integer in [1, {_PAGE_LIMIT}], got {limit_text!r}", param="limit")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if "after" in query:
        ids = [item.get("id") for item in ordered]
        if query["after"] not in ids:
            raise ApiError(404, f"Item with id '{query['after']}' not found.", param="after", code="not_found")
        start = ids.index(query["after"]) + 1
    page = [_listed(item) for item in ordered[start : start + int(limit_text)]]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": start + len(page) < len(ordered),
    }
