"""StopMatcher: a stop string split across deltas is caught and never partially streamed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from himamba.services.tokenizer.stop import StopMatcher, StopResult

_ALPHABET = "abé日🎉 "  # a small alphabet makes matches and near-misses common


def _split(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def _run(stops: list[str], deltas: list[str]) -> tuple[list[str], bool]:
    """Feed the deltas as a server would; returns what was streamed and whether it stopped."""
    m = StopMatcher(stops)
    streamed: list[str] = []
    for d in deltas:
        r = m.feed(d)
        streamed.append(r.emit)
        if r.stopped:
            return streamed, True
    streamed.append(m.flush())
    return streamed, False


def _reference(text: str, stops: list[str]) -> str:
    """The text up to the stop string completed first (ties: the earliest start)."""
    ends = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    return text[: min(ends)[1]] if ends else text


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet=_ALPHABET, max_size=30),
    stop=st.text(alphabet=_ALPHABET, min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 100), max_size=10),
)
def test_one_stop_string_gives_the_text_before_its_first_occurrence(text: str, stop: str, cuts: list[int]) -> None:
    streamed, stopped = _run([stop], _split(text, cuts))
    i = text.find(stop)
    assert "".join(streamed) == (text[:i] if i >= 0 else text)
    assert stopped == (i >= 0)


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet=_ALPHABET, max_size=30),
    stops=st.lists(st.text(alphabet=_ALPHABET, min_size=1, max_size=4), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 100), max_size=10),
)
def test_several_stop_strings_do_not_depend_on_the_split(text: str, stops: list[str], cuts: list[int]) -> None:
    streamed, stopped = _run(stops, _split(text, cuts))
    assert "".join(streamed) == _reference(text, stops)
    assert stopped == any(s in text for s in stops)
    # Never stream anything that a later delta could turn into (part of) a stop string.
    prefix = ""
    for piece in streamed:
        prefix += piece
        assert not any(s in prefix for s in stops)


def test_a_stop_split_over_deltas_is_held_back_then_dropped() -> None:
    m = StopMatcher(["</end>"])
    assert m.feed("hello </") == StopResult("hello ", False)
    assert m.feed("en") == StopResult("", False)
    assert m.feed("d> tail") == StopResult("", True)
    assert m.stopped
    assert m.feed("more") == StopResult("", True)
    assert m.flush() == ""


def test_a_near_miss_is_released() -> None:
    m = StopMatcher(["</end>"])
    assert m.feed("a </en") == StopResult("a ", False)
    assert m.feed("x") == StopResult("</enx", False)
    assert m.feed("</") == StopResult("", False)
    assert m.flush() == "</"


def test_the_stop_completed_first_wins() -> None:
    # "c" completes at index 2, before "abcd" completes: generation would have halted there.
    assert _run(["abcd", "c"], ["abcd"]) == (["ab"], True)
    assert _run(["abcd", "c"], ["a", "b", "c", "d"]) == (["", "", "ab"], True)


def test_no_stops_pass_everything_through() -> None:
    m = StopMatcher([])
    assert m.feed("abc") == StopResult("abc", False)
    assert m.flush() == ""


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError, match="stop"):
        StopMatcher(["ok", ""])
