"""RequestOutput: chunks, usage and stop strings for one request, without any socket."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from himamba.common.messages import TokenOut
from himamba.common.types import CachedTokens
from himamba.services.tokenizer.output import RequestOutput

TEXT = "héllo wörld 日本語 🎉"


def _outs(ids: list[int], reason: str | None = "length") -> list[TokenOut]:
    return [
        TokenOut(
            rid="r",
            token_ids=[t],
            finish_reason=reason if i == len(ids) - 1 else None,
            prompt_tokens=3,
            completion_tokens=i + 1,
            cached=CachedTokens(device=1, host=2, storage=3) if i == 0 else None,
        )
        for i, t in enumerate(ids)
    ]


def test_streaming_deltas_and_final_usage(demo_tokenizer: Tokenizer) -> None:
    ids = demo_tokenizer.encode(TEXT).ids
    out = RequestOutput("c1", demo_tokenizer, stream=True, stops=[], prompt_len=3, prompt_token_ids=[7, 8, 9])
    steps = [out.on_token_out(o) for o in _outs(ids)]
    chunks = [s.chunk for s in steps if s.chunk is not None]
    assert len(chunks) == len(ids)  # every token is reported, even while its text is held back
    assert "".join(c.text for c in chunks) == TEXT
    assert [s.finished for s in steps] == [False] * (len(ids) - 1) + [True]
    assert not any(s.stop_string_hit for s in steps)
    assert chunks[0].prompt_token_ids == [7, 8, 9] and chunks[1].prompt_token_ids is None
    final = chunks[-1]
    assert final.rid == "c1" and final.finish_reason == "length"
    assert final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (3, len(ids))
    assert final.usage.cached_tokens == CachedTokens(device=1, host=2, storage=3)


def test_non_stream_sends_one_chunk_with_everything(demo_tokenizer: Tokenizer) -> None:
    ids = demo_tokenizer.encode(TEXT).ids
    out = RequestOutput("c2", demo_tokenizer, stream=False, stops=[], prompt_len=3)
    chunks = [s.chunk for o in _outs(ids) if (s := out.on_token_out(o)).chunk is not None]
    assert len(chunks) == 1
    assert chunks[0].text == TEXT and chunks[0].token_ids == ids and chunks[0].finished


def test_stop_string_inside_a_split_character_run(demo_tokenizer: Tokenizer) -> None:
    ids = demo_tokenizer.encode(TEXT).ids
    out = RequestOutput("c3", demo_tokenizer, stream=True, stops=["本語"], prompt_len=3)
    text = ""
    for o in _outs(ids):
        step = out.on_token_out(o)
        if step.chunk is not None:
            text += step.chunk.text
        if step.finished:
            assert step.stop_string_hit and step.chunk is not None and step.chunk.finish_reason == "stop"
            break
    else:
        raise AssertionError("the stop string was never seen")
    assert text == "héllo wörld 日"


def test_stop_string_in_the_last_output_needs_no_stop_request(demo_tokenizer: Tokenizer) -> None:
    ids = demo_tokenizer.encode("ab ").ids
    out = RequestOutput("c4", demo_tokenizer, stream=False, stops=["b "], prompt_len=1)
    steps = [out.on_token_out(o) for o in _outs(ids, reason="length")]
    final = steps[-1]
    assert final.finished and final.chunk is not None
    assert final.chunk.text == "a" and final.chunk.finish_reason == "stop"
    assert not final.stop_string_hit  # the scheduler already finished this request


def test_abort_releases_held_text(demo_tokenizer: Tokenizer) -> None:
    out = RequestOutput("c5", demo_tokenizer, stream=True, stops=["xyz"], prompt_len=1)
    step = out.on_token_out(TokenOut(rid="r", token_ids=demo_tokenizer.encode("hi x").ids))
    assert step.chunk is not None and step.chunk.text == "hi "
    final = out.finish("abort")
    assert final.finished and final.finish_reason == "abort" and final.text == "x"
    assert final.usage is not None and final.usage.completion_tokens == len(demo_tokenizer.encode("hi x").ids)


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(
    ("stops", "last", "reason", "stop_reason", "matched_stop"),
    [
        (["wörld"], None, "length", "wörld", "wörld"),  # the stop string, whatever the engine said
        ([], 0, "stop", None, 0),  # EOS: vLLM says null, sglang names the EOS id
        ([], 7, "stop", 7, 7),  # a stop_token_ids entry
        ([], 0, "length", None, None),  # cut by max_tokens
    ],
)
def test_what_stopped_the_answer(
    demo_tokenizer: Tokenizer, stream: bool, stops: list[str], last: int | None, reason: str, stop_reason, matched_stop
) -> None:
    ids = demo_tokenizer.encode(TEXT).ids + ([last] if last is not None else [])
    out = RequestOutput(
        "c6",
        demo_tokenizer,
        stream=stream,
        stops=stops,
        prompt_len=1,
        eos_ids=frozenset({0}),
        stop_token_ids=frozenset({7}),
    )
    chunks = []
    for o in _outs(ids, reason=reason):
        step = out.on_token_out(o)
        if step.chunk is not None:
            chunks.append(step.chunk)
        if step.finished:
            break
    final = chunks[-1]
    assert final.finished and (final.stop_reason, final.matched_stop) == (stop_reason, matched_stop)
    assert all(c.stop_reason is None and c.matched_stop is None for c in chunks[:-1])


def test_ignore_eos_reports_no_eos(demo_tokenizer: Tokenizer) -> None:
    """Under ignore_eos the front door passes no EOS ids: an EOS id that is also a stop token is that."""
    out = RequestOutput("c7", demo_tokenizer, stream=False, stops=[], prompt_len=1, stop_token_ids=frozenset({0}))
    final = [s.chunk for o in _outs([5, 0], reason="stop") if (s := out.on_token_out(o)).chunk is not None][-1]
    assert (final.stop_reason, final.matched_stop) == (0, 0)
