"""What the worker gets for one step: a RunBatch whose size is proportional to what changed.

The worker keeps each running request's page table (and its sampling state) from step to step,
so a decode step sends, per request, one token, its slot and the pages appended or re-pointed
since its last step, never its whole page table or context. A request's first step after an
admission sends its whole table once (`reset`), with its sampling parameters; requests that
finished or were retracted since the last batch are named in `dropped`.
"""

from __future__ import annotations

from himamba.common.messages import RunBatch, SeqPlan, Transfer
from himamba.common.wire import IntsFrame
from himamba.services.scheduler.batching import BatchPlan
from himamba.services.scheduler.captures import Capture
from himamba.services.scheduler.request import Req


def _seq_plan(req: Req, n: int, caps: list[Capture], pages: list[int]) -> SeqPlan:
    """One sequence's plan; appends its page-table delta to `pages` and marks it sent."""
    start = req.computed_len
    reset = req.table_reset
    num_pages = len(req.pages)
    page_start = 0 if reset else min(req.pages_sent, req.pages_dirty)
    if page_start < num_pages:
        pages.extend(req.pages[page_start:])
        req.pages_sent = num_pages
        req.pages_dirty = 1 << 62
    if not reset:  # the common step: positional, nothing but what changed
        return SeqPlan(
            req.rid, start, n, req.slots[0], req.state_init, req.state_src,
            [(c.pos - start, c.slot) for c in caps] if caps else [], len(req.output_ids), False,
            page_start, num_pages - page_start,
        )  # fmt: skip
    req.table_reset = False
    return SeqPlan(
        rid=req.rid,
        prefix_len=start,
        new_len=n,
        state_slot=req.working_slot,
        state_init=req.state_init,
        state_src=req.state_src,
        captures=[(c.pos - start, c.slot) for c in caps],
        step=len(req.output_ids),
        reset=True,
        page_start=0,
        num_new_pages=num_pages,
        sampling=req.sampling,
        history=req.tokens(0, start) if req.sampling.penalised else [],
        num_prompt=len(req.prompt_ids),
    )


def build_run_batch(
    batch_id: int,
    plan: BatchPlan,
    captures: dict[str, list[Capture]],
    transfers: list[Transfer],
    dropped: list[str],
) -> tuple[RunBatch, list[IntsFrame]]:
    """The RunBatch of `plan` and its frames (input ids, page-table deltas)."""
    seqs: list[SeqPlan] = []
    ids: list[int] = []
    pages: list[int] = []
    no_caps: list[Capture] = []
    for req, n in plan.items:
        if n == 1 and req.computed_len >= len(req.prompt_ids):
            ids.append(req.output_ids[req.computed_len - len(req.prompt_ids)])  # decode: one token
        else:
            ids.extend(req.tokens(req.computed_len, n))
        seqs.append(_seq_plan(req, n, captures.get(req.rid, no_caps), pages))
    ids_f, pages_f = IntsFrame(ids), IntsFrame(pages)
    msg = RunBatch(
        batch_id=batch_id,
        mode=plan.mode,
        seqs=seqs,
        input_ids=ids_f.ref(0),
        pages=pages_f.ref(1),
        transfers=transfers,
        dropped=dropped,
    )
    return msg, [ids_f, pages_f]
