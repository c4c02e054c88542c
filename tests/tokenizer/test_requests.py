"""RequestTable: per-client rids, duplicate refusal, removal of a departed client's requests, the
samples of an n > 1 request."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer

from himamba.services.tokenizer.output import RequestOutput
from himamba.services.tokenizer.requests import RequestEntry, RequestTable, internal_rid


def _entry(tok: Tokenizer, identity: bytes, rid: str, index: int = 0) -> RequestEntry:
    out = RequestOutput(rid, tok, stream=True, stops=[], prompt_len=1, index=index)
    return RequestEntry(internal_rid(identity, rid, index), identity, rid, out, index=index)


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


@given(
    rids=st.lists(st.text(alphabet="ab.:0123", max_size=6), min_size=1, max_size=6, unique=True),
    identities=st.lists(st.binary(min_size=1, max_size=3), min_size=1, max_size=3, unique=True),
)
def test_internal_rids_of_samples_never_collide(rids: list[str], identities: list[bytes]) -> None:
    # Client rids may hold any character, including the separators of the internal rids.
    keys = [(ident, rid, i) for ident in identities for rid in rids for i in range(3)]
    assert len({internal_rid(*k) for k in keys}) == len(keys)
    assert internal_rid(b"\x01", "r") == "01:r"  # sample 0 keeps the n = 1 form


def test_samples_of_a_request_are_in_flight_together(demo_tokenizer: Tokenizer) -> None:
    table = RequestTable()
    samples = [_entry(demo_tokenizer, b"\x01", "r", i) for i in (2, 0, 1)]
    for e in samples:
        table.add(e)
    table.add(_entry(demo_tokenizer, b"\x01", "other"))
    assert [e.index for e in table.samples(b"\x01", "r")] == [0, 1, 2]
    table.pop(internal_rid(b"\x01", "r", 0))
    assert table.in_flight(b"\x01", "r")  # samples 1 and 2 still run
    assert [e.index for e in table.pop_request(b"\x01", "r")] == [1, 2]
    assert not table.in_flight(b"\x01", "r") and table.samples(b"\x01", "r") == []
    assert table.in_flight(b"\x01", "other") and len(table) == 1
    assert table.pop_request(b"\x02", "r") == []
