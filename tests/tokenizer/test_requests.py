"""RequestTable: per-client rids, duplicate refusal, removal of a departed client's requests."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from himamba.services.tokenizer.output import RequestOutput
from himamba.services.tokenizer.requests import RequestEntry, RequestTable, internal_rid


def _entry(tok: Tokenizer, identity: bytes, rid: str) -> RequestEntry:
    out = RequestOutput(rid, tok, stream=True, stops=[], prompt_len=1)
    return RequestEntry(internal_rid(identity, rid), identity, rid, out)


def test_same_client_rid_on_two_connections_does_not_collide(demo_tokenizer: Tokenizer) -> None:
    table = RequestTable()
    a, b = _entry(demo_tokenizer, b"\x00A", "1"), _entry(demo_tokenizer, b"\x00B", "1")
    table.add(a)
    table.add(b)
    assert a.rid != b.rid and len(table) == 2
    assert table.get(a.rid) is a and table.get(b.rid) is b


def test_duplicate_in_flight_rid_is_refused(demo_tokenizer: Tokenizer) -> None:
    table = RequestTable()
    table.add(_entry(demo_tokenizer, b"\x01", "x"))
    with pytest.raises(ValueError, match="already in flight"):
        table.add(_entry(demo_tokenizer, b"\x01", "x"))
    table.pop(internal_rid(b"\x01", "x"))
    table.add(_entry(demo_tokenizer, b"\x01", "x"))  # free again once finished


def test_pop_client_removes_only_that_client(demo_tokenizer: Tokenizer) -> None:
    table = RequestTable()
    for ident, rid in [(b"\x01", "a"), (b"\x01", "b"), (b"\x02", "a")]:
        table.add(_entry(demo_tokenizer, ident, rid))
    gone = table.pop_client(b"\x01")
    assert sorted(e.client_rid for e in gone) == ["a", "b"]
    assert [e.identity for e in table.entries()] == [b"\x02"]
    assert table.pop_client(b"\x01") == []
    assert table.pop("missing") is None
