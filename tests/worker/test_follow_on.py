"""A decode step sent before the results of the step it follows (services/worker/follow_on.py):
its inputs are that step's tokens; the sequences those stop, or whose sampling failed, leave it."""

from __future__ import annotations

import pytest
import torch

from himamba.common.messages import BatchDone, RunBatch, SeqPlan
from himamba.common.wire import IntsFrame, encode, get_tensor
from himamba.services.worker.follow_on import FollowError, resolve, sampled


def _seq(rid: str, pages: int = 0, stop_ids: list[int] | None = None) -> SeqPlan:
    return SeqPlan(rid, 10, 1, 0, num_new_pages=pages, stop_ids=stop_ids or [])


def _frames(msg: RunBatch, tensors: list[IntsFrame]) -> list[memoryview]:
    return [memoryview(f) for f in encode(msg, tensors)[1:]]


def test_each_sequence_reads_its_token_and_those_that_stop_or_failed_leave() -> None:
    before = RunBatch(batch_id=4, mode="decode", seqs=[_seq("a"), _seq("b"), _seq("c"), _seq("d")])
    last = sampled(before, BatchDone(batch_id=4, next_tokens=[11, 2, 13, 14], seq_errors={2: "nan"}))
    pages = IntsFrame([100, 101, 102, 103])
    # Its order differs from the step it follows; "e" was not in it.
    seqs = [_seq("d", 1), _seq("b", 2, stop_ids=[2]), _seq("a", 0, stop_ids=[2, 7]), _seq("c", 1), _seq("e")]
    msg = RunBatch(batch_id=5, mode="decode", seqs=seqs, pages=pages.ref(0), follows=4)
    got = resolve(msg, _frames(msg, [pages]), last)
    assert got.left_out == ["b", "c", "e"]
    assert [q.rid for q in got.msg.seqs] == ["d", "a"] and got.msg.follows == -1
    assert get_tensor(got.frames, got.msg.input_ids).tolist() == [14, 11]
    # The page deltas of the sequences that stay, in their order: d's [100]; b's [101, 102] go.
    assert get_tensor(got.frames, got.msg.pages).tolist() == [100]


def test_a_step_that_follows_a_failed_or_another_step_cannot_run() -> None:
    msg = RunBatch(batch_id=5, mode="decode", seqs=[_seq("a")], pages=IntsFrame([]).ref(0), follows=4)
    frames = _frames(msg, [IntsFrame([])])
    failed = RunBatch(batch_id=4, mode="decode", seqs=[_seq("a")])
    assert sampled(failed, BatchDone(batch_id=4, next_tokens=[], error="boom")) is None
    with pytest.raises(FollowError, match="follows batch 4"):
        resolve(msg, frames, None)
    other = sampled(RunBatch(batch_id=3, mode="decode", seqs=[_seq("a")]), BatchDone(batch_id=3, next_tokens=[5]))
    with pytest.raises(FollowError, match="follows batch 4"):
        resolve(msg, frames, other)


def test_every_sequence_may_leave() -> None:
    last = sampled(RunBatch(batch_id=1, mode="decode", seqs=[_seq("a")]), BatchDone(batch_id=1, next_tokens=[2]))
    msg = RunBatch(batch_id=2, mode="decode", seqs=[_seq("a", stop_ids=[2])], pages=IntsFrame([]).ref(0), follows=1)
    got = resolve(msg, _frames(msg, [IntsFrame([])]), last)
    assert got.left_out == ["a"] and got.msg.seqs == []
    assert get_tensor(got.frames, got.msg.input_ids).numel() == 0
    assert torch.equal(get_tensor(got.frames, got.msg.pages), torch.empty(0, dtype=torch.int64))
