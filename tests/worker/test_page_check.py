"""A RunBatch's pages are checked on the host copy, before it goes to the worker's device: a page
out of range is refused by name, and nothing of the batch is applied."""

from __future__ import annotations

import pytest
import torch

from himamba.common.messages import RunBatch, SeqPlan
from himamba.common.types import SamplingParams
from himamba.common.wire import WireError, tensor_frame, tensor_ref
from himamba.services.worker.page_tables import PageTables
from himamba.services.worker.runner import build_forward_batch

NUM_PAGES, PAGE = 8, 4


def _plan(pages: list[int]) -> tuple[RunBatch, list[memoryview]]:
    ids = torch.tensor([5, 6, 7], dtype=torch.int64)
    pages_t = torch.tensor(pages, dtype=torch.int64)
    seqs = [
        SeqPlan("a", 0, 2, 0, reset=True, num_new_pages=1, sampling=SamplingParams()),
        SeqPlan("b", 0, 1, 1, reset=True, num_new_pages=len(pages) - 1, sampling=SamplingParams()),
    ]
    plan = RunBatch(1, "prefill", seqs, input_ids=tensor_ref(ids, 0), pages=tensor_ref(pages_t, 1))
    return plan, [tensor_frame(ids), tensor_frame(pages_t)]


def test_pages_in_range_are_applied() -> None:
    tables = PageTables(PAGE, NUM_PAGES, vocab_size=16, device=torch.device("cpu"))
    plan, frames = _plan([3, 7])
    batch, _ = build_forward_batch(plan, frames, tables, num_slots=4, device=torch.device("cpu"))
    assert batch.write_slots.tolist() == [12, 13, 28]


@pytest.mark.parametrize("bad", [NUM_PAGES, -1], ids=["past-the-pool", "negative"])
def test_a_page_out_of_range_is_refused_before_anything_is_applied(bad: int) -> None:
    tables = PageTables(PAGE, NUM_PAGES, vocab_size=16, device=torch.device("cpu"))
    plan, frames = _plan([3, bad])
    with pytest.raises(WireError, match="b: page index out of range"):
        build_forward_batch(plan, frames, tables, num_slots=4, device=torch.device("cpu"))
    assert len(tables) == 0  # sequence "a" (in range, earlier in the batch) got no table either
