"""scheduler/logprobs.py: the prompt-logprob spans of a request's prefill chunks are gathered
once each, in order; a retracted request's recomputed spans are not taken twice; a gap (a
position never computed) is an error on the first token, never a short list."""

from __future__ import annotations

from himamba.common.messages import BatchDone, PromptLogprobs, TokenLogprobs
from himamba.common.types import SamplingParams
from himamba.services.scheduler import logprobs
from himamba.services.scheduler.request import Req


def _req(prompt_len: int) -> Req:
    return Req("r", list(range(prompt_len)), SamplingParams(prompt_logprobs=1), 4, frozenset())


def _span(start: int, end: int) -> PromptLogprobs:
    return PromptLogprobs(start, [TokenLogprobs(-float(p)) for p in range(start, end)])


def test_spans_are_gathered_once_each_in_order():
    req = _req(10)
    logprobs.absorb_prompt(req, _span(1, 4))
    logprobs.absorb_prompt(req, _span(4, 10))
    logprobs.absorb_prompt(req, _span(1, 6))  # recomputed after a retraction: already held
    assert [e.logprob for e in req.prompt_logprobs] == [-float(p) for p in range(1, 10)]
    assert logprobs.prompt_logprobs_error(req) == ""
    assert logprobs.first_prompt_logprobs(req) == req.prompt_logprobs
    assert logprobs.first_prompt_logprobs(req) is None  # sent once, with the first token


def test_a_gap_or_a_short_list_is_an_error():
    req = _req(10)
    logprobs.absorb_prompt(req, _span(1, 4))
    assert logprobs.prompt_logprobs_error(req)  # short
    logprobs.absorb_prompt(req, _span(5, 10))  # position 4 missing
    assert logprobs.prompt_logprobs_error(req)
    plain = Req("p", [1, 2, 3], SamplingParams(), 4, frozenset())
    assert logprobs.prompt_logprobs_error(plain) == "" and logprobs.first_prompt_logprobs(plain) is None


def test_token_logprobs_of_the_sampled_token():
    req = Req("r", [1, 2], SamplingParams(logprobs=True, top_logprobs=2), 4, frozenset())
    entry = TokenLogprobs(-0.5, [3, 4], [-0.5, -1.0], 1)
    done = BatchDone(batch_id=1, next_tokens=[3, 9], token_logprobs={0: entry})
    assert logprobs.token_logprobs(req, done, 0) == ([-0.5], [entry])
    assert logprobs.token_logprobs(req, done, 1) == (None, None)
    assert req.logprobs == [-0.5]
