"""The next decode step built during the current one (services/scheduler/decode_ahead.py): what
it sends once the current step's tokens are in, and when it must not exist."""

from __future__ import annotations

import copy

import pytest

from himamba.common.messages import BatchDone, RunBatch
from himamba.common.types import SamplingParams
from himamba.services.scheduler import captures, decode_ahead
from himamba.services.scheduler.batching import BatchPlan
from himamba.services.scheduler.request import Req
from himamba.services.scheduler.worker_batch import build_run_batch

PAGE = 4
INTERVAL = 8
MAX_CONTEXT = 1000
EOS = frozenset({2})


def _req(i: int, prompt: int = 9, output: int = 1, **sampling: object) -> Req:
    """A running request at steady decode: `prompt + output - 1` tokens computed, the newest
    output token not yet fed; pages for one more token; its table already sent."""
    req = Req(f"r{i}", list(range(10, 10 + prompt)), SamplingParams(**sampling), 100, EOS)  # type: ignore[arg-type]
    req.status = "running"
    req.output_ids = [50 + i] * output
    req.computed_len = prompt + output - 1
    num_pages = (req.computed_len + 2 + PAGE - 1) // PAGE
    req.pages = [100 * i + p for p in range(num_pages)]
    req.slots = [i, 20 + i]
    req.track_slots = [20 + i]
    req.state_init = "keep"
    req.table_reset = False
    req.pages_sent = num_pages - i % 2  # odd ones: their newest page is not sent yet
    return req


def _decode(reqs: list[Req]) -> BatchPlan:
    return BatchPlan("decode", [(r, 1) for r in reqs])


def _prebuild(reqs: list[Req], strategy: str = "extra_buffer") -> decode_ahead.Ahead | None:
    return decode_ahead.prebuild(_decode(reqs), reqs, strategy, INTERVAL, PAGE, MAX_CONTEXT)  # type: ignore[arg-type]


def _continue(ahead: decode_ahead.Ahead, tokens: list[int], leaving: set[str] | None = None, **done: object):
    msg = BatchDone(batch_id=1, next_tokens=tokens, **done)  # type: ignore[arg-type]
    return decode_ahead.continue_with(ahead, msg, 7, leaving or set(), MAX_CONTEXT, [], [])


def _captures(reqs: list[Req], strategy: str) -> dict[str, list[captures.Capture]]:
    found = {r.rid: captures.captures_for(r, "decode", 1, strategy, INTERVAL, PAGE) for r in reqs}  # type: ignore[arg-type]
    return {rid: c for rid, c in found.items() if c}


@pytest.mark.parametrize("strategy", ["extra_buffer", "extra_buffer_lazy", "single_buffer", "no_buffer"])
def test_the_prebuilt_step_is_the_step_built_after_the_results(strategy: str) -> None:
    """Same sequences, positions, captures and page deltas as the usual build once step N's
    results are handled (tokens appended, N's captures committed); its input ids are N's tokens.
    Contexts cross page and track boundaries (in step N and in step N+1), two requests had a sent
    page re-pointed, one has admission captures due in both steps."""
    reqs = [_req(i, prompt=4 + i) for i in range(8)]
    for i, r in enumerate(reqs):
        if i in (2, 5):
            r.pages_dirty = 1
        if strategy != "single_buffer":
            r.track_slots = [20 + i, 40 + i]
            r.slots = [r.slots[0], *r.track_slots]
        if strategy == "extra_buffer_lazy":
            r.newest_track_slot = r.track_slots[0]
    reqs[3].pending_captures = [(reqs[3].computed_len + 1, 77), (reqs[3].computed_len + 2, 78)]
    reqs[3].slots += [77, 78]
    twins = copy.deepcopy(reqs)
    in_flight = _captures(twins, strategy)  # step N's
    ahead = _prebuild(reqs, strategy)
    assert ahead is not None
    tokens = [60 + i for i in range(8)]
    sent = _continue(ahead, tokens)
    assert sent is not None and not sent.left
    for r, token in zip(twins, tokens, strict=True):  # what handling step N's results does
        r.computed_len += 1
        r.output_ids.append(token)
        r.state_init = "keep"
        if r.rid in in_flight:
            captures.commit(r, in_flight[r.rid], strategy)  # type: ignore[arg-type]
    caps = _captures(twins, strategy)
    if strategy != "no_buffer":
        assert caps and in_flight, "the case should have captures in both steps"
    usual, frames = build_run_batch(7, _decode(twins), caps, [], [])
    assert sent.msg.seqs == usual.seqs
    assert list(sent.frames[0].values) == list(frames[0].values) == tokens
    assert list(sent.frames[1].values) == list(frames[1].values)
    assert sent.caps == caps
    assert [(r.pages_sent, r.pages_dirty) for r in reqs] == [(t.pages_sent, t.pages_dirty) for t in twins]


def test_requests_that_stop_with_this_token_leave_the_next_step() -> None:
    reqs = [
        _req(0),
        _req(1),  # samples EOS
        _req(2, ignore_eos=True),  # samples EOS but ignores it
        _req(3, stop_token_ids=[7]),  # samples its stop token
        _req(4),  # aborted since the step was sent
        _req(5),  # its sampling failed
        _req(6, output=99),  # its 100th token: max_tokens
    ]
    ahead = _prebuild(reqs)
    assert ahead is not None
    sent = _continue(ahead, [5, 2, 2, 7, 5, 5, 5], leaving={"r4"}, seq_errors={5: "nan"})
    assert sent is not None
    assert sent.left == {1, 3, 4, 5, 6}
    assert [s.rid for s in sent.msg.seqs] == ["r0", "r2"]
    assert [r.rid for r, _ in sent.plan.items] == ["r0", "r2"]
    assert list(sent.frames[0].values) == [5, 2]
    # Only the page deltas of the requests sent go, and only theirs are marked as sent.
    assert [s.num_new_pages for s in sent.msg.seqs] == [0, 0]
    assert len(sent.frames[1].values) == 0
    assert reqs[1].pages_sent == len(reqs[1].pages) - 1


def test_a_failed_step_or_no_one_left_sends_nothing() -> None:
    reqs = [_req(0), _req(1)]
    ahead = _prebuild(reqs)
    assert ahead is not None
    before = [(r.pages_sent, r.pages_dirty) for r in reqs]
    assert _continue(ahead, [5, 5], error="boom") is None
    assert _continue(ahead, [2, 2]) is None  # both stop
    assert [(r.pages_sent, r.pages_dirty) for r in reqs] == before  # nothing committed


def test_no_prebuilt_step_when_the_next_one_is_not_this_one_again() -> None:
    reqs = [_req(i) for i in range(3)]
    # A request admitted during this step (a prefill comes next).
    assert decode_ahead.prebuild(_decode(reqs[:2]), reqs, "extra_buffer", INTERVAL, PAGE, MAX_CONTEXT) is None
    # A prefill step.
    plan = BatchPlan("prefill", [(r, 1) for r in reqs])
    assert decode_ahead.prebuild(plan, reqs, "extra_buffer", INTERVAL, PAGE, MAX_CONTEXT) is None
    # A page for the next token is missing (the overlap window could not get it).
    short = [_req(i) for i in range(3)]
    short[1].pages = short[1].pages[:-1]
    short[1].pages_sent = min(short[1].pages_sent, len(short[1].pages))
    assert _prebuild(short) is None
    # A lazy request at a track boundary without its boundary slot.
    lazy = [_req(i, prompt=INTERVAL - 2) for i in range(2)]  # the step after this one reaches 8
    lazy[0].newest_track_slot = lazy[0].track_slots[0]
    assert _prebuild(lazy, "extra_buffer_lazy") is None
    lazy[0].track_slots.append(40)
    lazy[0].slots.append(40)
    lazy[1].newest_track_slot = None
    assert _prebuild(lazy, "extra_buffer_lazy") is not None
    # A request whose table is still to be sent whole.
    fresh = [_req(i) for i in range(2)]
    fresh[0].table_reset = True
    assert _prebuild(fresh) is None


def test_building_ahead_changes_no_request() -> None:
    reqs = [_req(i, prompt=6 + i) for i in range(6)]
    before = copy.deepcopy([vars(r) for r in reqs])
    assert _prebuild(reqs) is not None
    assert [vars(r) for r in reqs] == before


def test_the_message_is_a_decode_run_batch() -> None:
    ahead = _prebuild([_req(0)])
    assert ahead is not None
    sent = _continue(ahead, [5])
    assert sent is not None and isinstance(sent.msg, RunBatch) and sent.msg.mode == "decode"
    assert sent.msg.batch_id == 7
