"""IncrementalDetokenizer: deltas concatenate to the full decode and never show a split character."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from himamba.services.tokenizer.detokenize import IncrementalDetokenizer

_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
_MULTIBYTE = "héllo wörld 日本語 🎉"


def _feed(detok: IncrementalDetokenizer, ids: list[int], cuts: list[int]) -> list[str]:
    """Add `ids` in pieces split at `cuts`, then flush; returns every delta."""
    bounds = sorted({0, len(ids), *(c % (len(ids) + 1) for c in cuts)})
    deltas = [detok.add(ids[a:b]) for a, b in zip(bounds, bounds[1:])]
    return deltas + [detok.flush()]


def test_multibyte_text_one_token_at_a_time(demo_tokenizer: Tokenizer) -> None:
    ids = demo_tokenizer.encode(_MULTIBYTE).ids
    detok = IncrementalDetokenizer(demo_tokenizer)
    deltas = [detok.add([t]) for t in ids] + [detok.flush()]
    assert "".join(deltas) == _MULTIBYTE
    assert not any("\ufffd" in d for d in deltas)
    # Some character is split over tokens, so some step had nothing stable to emit.
    assert len(ids) > len(_MULTIBYTE.split()) and "" in deltas[:-1]
    assert detok.token_ids == ids


@_SETTINGS
@given(text=st.text(min_size=1, max_size=40), cuts=st.lists(st.integers(0, 200), max_size=8))
def test_valid_text_round_trips_without_replacement_chars(
    demo_tokenizer: Tokenizer, text: str, cuts: list[int]
) -> None:
    ids = demo_tokenizer.encode(text).ids
    deltas = _feed(IncrementalDetokenizer(demo_tokenizer), ids, cuts)
    assert "".join(deltas) == demo_tokenizer.decode(ids)
    if "\ufffd" not in text:
        assert not any("\ufffd" in d for d in deltas)


@_SETTINGS
@given(
    ids=st.lists(st.integers(0, 2047), max_size=30),
    cuts=st.lists(st.integers(0, 200), max_size=8),
    skip=st.booleans(),
)
def test_random_ids_concatenate_to_the_full_decode(
    demo_tokenizer: Tokenizer, ids: list[int], cuts: list[int], skip: bool
) -> None:
    deltas = _feed(IncrementalDetokenizer(demo_tokenizer, skip_special_tokens=skip), ids, cuts)
    assert "".join(deltas) == demo_tokenizer.decode(ids, skip_special_tokens=skip)


def test_emoji_bytes_are_held_until_complete(demo_tokenizer: Tokenizer) -> None:
    # Four byte-level tokens, one per UTF-8 byte of the emoji: nothing until the last one.
    byte_ids = [demo_tokenizer.token_to_id(ch) for ch in "ðŁİī"]  # the byte-level spelling of 🎉
    assert None not in byte_ids
    detok = IncrementalDetokenizer(demo_tokenizer)
    assert [detok.add([t]) for t in byte_ids] == ["", "", "", "🎉"]
    assert detok.flush() == ""


def test_flush_releases_an_incomplete_character_as_replacement(demo_tokenizer: Tokenizer) -> None:
    first_byte = demo_tokenizer.token_to_id("ð")  # 0xF0: starts a 4-byte character
    detok = IncrementalDetokenizer(demo_tokenizer)
    assert detok.add([first_byte]) == ""
    assert detok.flush() == "\ufffd"


def test_parser_markup_stays_in_the_text_even_when_special(demo_tokenizer: Tokenizer) -> None:
    """A tokenizer that marks `<tool_call>` / `<think>` special (some do) must not hide a tool call
    or the thinking from the output parsers; other special tokens (end of text) are still skipped."""
    from tokenizers import AddedToken

    from himamba.services.tokenizer.detokenize import markup_token_ids

    tok = Tokenizer.from_str(demo_tokenizer.to_str())
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<tool_call>", "</tool_call>", "<think>")])
    keep = markup_token_ids(tok)
    assert len(keep) == 3 and tok.token_to_id("<|endoftext|>") not in keep
    text = '<think>hm</think>ok <tool_call>{"name": "f"}</tool_call>'
    ids = tok.encode(text, add_special_tokens=False).ids + [tok.token_to_id("<|endoftext|>")]
    for step in (1, 3):
        detok = IncrementalDetokenizer(tok, keep=keep)
        deltas = [detok.add(ids[i : i + step]) for i in range(0, len(ids), step)] + [detok.flush()]
        assert "".join(deltas) == text
    assert IncrementalDetokenizer(tok).add(ids) == 'hm</think>ok {"name": "f"}'  # what skipping would give
