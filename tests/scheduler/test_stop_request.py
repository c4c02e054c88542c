"""A stop string (StopRequest from the tokenizer) ends a request at the next step's results, as an
abort does: no token is sampled for it after the stop, and with a step already sent ahead it is
finished right after that step, not one or two steps later."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from himamba.common.config import Config
from himamba.common.messages import BatchDone, Release, TokenOut
from himamba.common.types import SamplingParams
from himamba.services.scheduler.batching import BatchPlan
from himamba.services.scheduler.request import Req
from himamba.services.scheduler.service import SchedulerService, _Sent

PROMPT = 16


@pytest.fixture
def service(tmp_path: Path):
    raw = msgspec.to_builtins(Config())
    for k in ("tokenizer_ipc", "scheduler_ipc", "worker_ipc", "cache_ipc", "control_ipc"):
        raw["endpoints"][k] = f"ipc://{tmp_path}/{k}"
    raw["cache"]["page_size"] = 4
    raw["cache"]["hicache_storage_backend"] = "none"
    s = SchedulerService(msgspec.convert(raw, Config))
    yield s
    s._close()


def _running(s: SchedulerService, rid: str) -> Req:
    req = Req(rid, list(range(10, 10 + PROMPT)), SamplingParams(), 100, frozenset({2}))
    req.status, req.pages, req.slots = "running", list(range(8)), [0]
    req.computed_len = PROMPT
    req.output_ids = [7]  # the prefill sampled one token; the next decode step computes it
    s.requests[rid] = req
    s.running.append(req)
    return req


def _outs_of(outs: list, rid: str) -> tuple[list[int], list[str]]:
    tokens, reasons = [], []
    for o in outs:
        if isinstance(o, TokenOut):
            if o.rid == rid:
                tokens += o.token_ids
                reasons += [o.finish_reason] if o.finish_reason else []
        else:
            out = SchedulerService._token_out(o)
            if out.rid == rid:
                tokens += out.token_ids
                reasons += [out.finish_reason] if out.finish_reason else []
    return tokens, reasons


def test_a_stopped_request_gets_no_token_and_ends_with_the_step_in_flight(service: SchedulerService) -> None:
    s = service
    req, mate = _running(s, "a"), _running(s, "b")
    s.on_abort("a", stop=True)  # the stop string was seen while this step ran
    outs: list = []
    s._on_batch_done(BatchPlan("decode", [(req, 1), (mate, 1)]), BatchDone(batch_id=1, next_tokens=[7, 7]), outs, {})
    assert _outs_of(outs, "a") == ([], ["stop"]), "a token sampled after the stop string was emitted"
    assert _outs_of(outs, "b") == ([7], [])
    assert req.status == "finished" and "a" not in s.requests and req not in s.running
    release = [op for op in s.cache.take_pending() if isinstance(op, Release) and op.rid == "a"]
    assert len(release) == 1 and len(release[0].tokens) <= PROMPT + 1  # nothing past the stop inserted


def test_a_stopped_request_in_the_step_sent_ahead_ends_right_after_it(service: SchedulerService) -> None:
    s = service
    req = _running(s, "a")
    s.on_abort("a", stop=True)
    plan = BatchPlan("decode", [(req, 1)])
    s._next = _Sent(plan, None, {}, frozenset({"a"}), ())  # type: ignore[arg-type]
    outs: list = []
    s._on_batch_done(plan, BatchDone(batch_id=1, next_tokens=[8]), outs, {})
    assert _outs_of(outs, "a") == ([], []) and req.status == "running"  # the step ahead still writes it
    # That step computes the token just sampled: it is context (for what the tree gets), not output.
    assert req.output_ids == [7, 8]
    s._next = None
    s._on_batch_done(plan, BatchDone(batch_id=2, next_tokens=[9]), outs, {})
    assert _outs_of(outs, "a") == ([], ["stop"]) and req.status == "finished"
    assert req.output_ids == [7, 8] and req.computed_len == PROMPT + 2
    context = req.prompt_ids + req.output_ids
    for op in s.cache.take_pending():
        if isinstance(op, Release) and op.rid == "a" and op.tokens:
            assert list(op.tokens) == context[: len(op.tokens)]
