"""The next decode step built during the current one and sent before its results
(services/scheduler/decode_ahead.py): what it sends, which of its requests run it once the current
step's tokens are in (the same answer as the worker's, services/worker/follow_on.py), and when it
must not exist."""

from __future__ import annotations

import copy

import msgspec
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


def _follow(ahead: decode_ahead.Ahead, leaving: set[str] | None = None) -> decode_ahead.Following | None:
    return decode_ahead.follow(ahead, 7, 1, leaving or set(), [], [])


def _ran(sent: decode_ahead.Following, tokens: list[int], **done: object) -> decode_ahead.Ran:
    return decode_ahead.ran(sent, BatchDone(batch_id=1, next_tokens=tokens, **done))  # type: ignore[arg-type]


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
    sent = _follow(ahead)
    assert sent is not None and sent.msg.follows == 1 and sent.msg.input_ids is None
    ran = _ran(sent, tokens)
    assert ran.plan == sent.plan and not ran.left_out
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
    # The usual build's message, but for the stop tokens the worker checks N's token against.
    assert [msgspec.structs.replace(q, stop_ids=[]) for q in sent.msg.seqs] == usual.seqs
    assert all(q.stop_ids == sorted(EOS) for q in sent.msg.seqs)
    assert list(frames[0].values) == tokens  # what the worker feeds from N's results
    assert list(sent.frames[0].values) == list(frames[1].values)
    assert sent.caps == ran.caps == caps
    assert [(r.pages_sent, r.pages_dirty) for r in reqs] == [(t.pages_sent, t.pages_dirty) for t in twins]


def test_requests_that_stop_with_this_token_leave_the_next_step() -> None:
    reqs = [
        _req(0),
        _req(1),  # samples EOS
        _req(2, ignore_eos=True),  # samples EOS but ignores it
        _req(3, stop_token_ids=[7]),  # samples its stop token
        _req(4),  # aborted before the step was sent
        _req(5),  # its sampling failed
        _req(6, output=99),  # its 100th token: max_tokens
        _req(7, stop_token_ids=[9]),  # aborted after the step was sent: it runs the step
    ]
    ahead = _prebuild(reqs)
    assert ahead is not None
    sent = _follow(ahead, leaving={"r4"})
    assert sent is not None
    # Known when it leaves: r4 is leaving, r6 ends by length.
    assert [s.rid for s in sent.msg.seqs] == ["r0", "r1", "r2", "r3", "r5", "r7"]
    assert [s.stop_ids for s in sent.msg.seqs] == [[2], [2], [], [2, 7], [2], [2, 9]]
    # Only the page deltas of the requests sent go (in their order), and only theirs are marked as sent.
    assert [s.num_new_pages for s in sent.msg.seqs] == [0, 1, 0, 1, 1, 1]
    assert list(sent.frames[0].values) == [reqs[i].pages[-1] for i in (1, 3, 5, 7)]
    assert all(reqs[i].pages_sent == len(reqs[i].pages) for i in (1, 3, 5, 7))
    ran = _ran(sent, [5, 2, 2, 7, 5, 5, 5, 5], seq_errors={5: "nan"})
    assert ran.left_out == ("r1", "r3", "r5")
    assert [r.rid for r, _ in ran.plan.items] == ["r0", "r2", "r7"]


def test_when_every_request_stops_none_runs() -> None:
    reqs = [_req(0), _req(1)]
    ahead = _prebuild(reqs)
    assert ahead is not None
    sent = _follow(ahead)
    assert sent is not None
    ran = _ran(sent, [2, 2])
    assert not ran.plan.items and ran.left_out == ("r0", "r1")
    assert _follow(ahead, leaving={"r0", "r1"}) is None  # nothing to send at all


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
    sent = _follow(ahead)
    assert sent is not None and isinstance(sent.msg, RunBatch) and sent.msg.mode == "decode"
    assert sent.msg.batch_id == 7 and sent.msg.follows == 1
