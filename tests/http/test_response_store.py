"""The stored responses of /v1/responses: bounded by count and bytes, least recently used first."""

from __future__ import annotations

import msgspec

from himamba.common.config import HttpConfig
from himamba.services.tokenizer.http.response_store import ResponseStore, expired


def _response(rid: str, text: str = "x") -> dict[str, object]:
    return {"id": rid, "output": [{"type": "message", "content": [{"type": "output_text", "text": text}]}]}


def _size(rid: str, text: str = "x") -> int:
    return len(msgspec.json.encode(_response(rid, text))) + len(msgspec.json.encode([{"t": text}]))


def test_count_bound_drops_the_least_recently_used():
    store = ResponseStore(max_count=2, max_bytes=1 << 20)
    assert store.put("a", _response("a"), [{"t": "x"}]) and store.put("b", _response("b"), [{"t": "x"}])
    assert store.get("a") is not None  # a is now the most recently used
    assert store.put("c", _response("c"), [{"t": "x"}])
    assert len(store) == 2 and store.get("b") is None
    assert store.get("a") is not None and store.get("c") is not None


def test_byte_budget_drops_until_it_fits():
    budget = 2 * _size("a") + 1
    store = ResponseStore(max_count=100, max_bytes=budget)
    store.put("a", _response("a"), [{"t": "x"}])
    store.put("b", _response("b"), [{"t": "x"}])
    assert store.bytes == 2 * _size("a") <= budget
    store.put("c", _response("c"), [{"t": "x"}])
    assert store.get("a") is None and len(store) == 2 and store.bytes <= budget


def test_too_large_or_disabled_is_not_kept():
    store = ResponseStore(max_count=10, max_bytes=_size("a") - 1)
    assert not store.put("a", _response("a"), [{"t": "x"}]) and len(store) == 0 and store.bytes == 0
    assert not ResponseStore(max_count=0, max_bytes=1 << 20).put("a", _response("a"), [])


def test_replace_and_delete_keep_the_byte_count():
    store = ResponseStore(max_count=10, max_bytes=1 << 20)
    store.put("a", _response("a"), [{"t": "x"}])
    store.put("a", _response("a", "longer"), [{"t": "longer"}])
    assert len(store) == 1 and store.bytes == _size("a", "longer")
    assert store.delete("a") and store.bytes == 0 and not store.delete("a")


def test_bounds_are_in_the_config_tree():
    cfg = HttpConfig()
    assert cfg.responses_store_max == 1000 and cfg.responses_store_mib == 64


def test_an_expired_response_is_gone_and_its_bytes_freed():
    store = ResponseStore(max_count=10, max_bytes=1 << 20, max_age_s=60)
    store.put("a", {**_response("a"), "created_at": 1000}, [{"t": "x"}])
    assert store.get("a", now=1060) is not None  # exactly the limit: still kept
    assert store.get("a", now=1061) is None
    assert len(store) == 0 and store.bytes == 0


def test_age_zero_is_no_limit_and_a_response_without_created_at_never_expires():
    assert not expired({"created_at": 0}, 0, now=1e12)
    assert not expired({"id": "x"}, 60, now=1e12)
    assert expired({"created_at": 0}, 60, now=61)


def test_the_age_bound_is_in_the_config_tree():
    assert HttpConfig().responses_store_max_age_s == 86400
