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


def _needs_history(req: Req, start: int) -> bool:
    return req.sampling.penalised or (req.sampling.grammar is not None and start > len(req.prompt_ids))


NO_CAPTURES: list[tuple[int, int]] = []  # shared by every plan without captures (never mutated)


def _reset_plan(req: Req, n: int, caps: list[Capture], pages: list[int]) -> SeqPlan:
    """A request's first step after an admission: its whole page table and sampling state."""
    start = req.computed_len
    pages.extend(req.pages)
    req.pages_sent = len(req.pages)
    req.pages_dirty = PAGES_CLEAN
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
        num_new_pages=len(req.pages),
        sampling=req.sampling,
        # Penalties count the whole context; a grammar's matcher is rebuilt from the outputs in it.
        history=req.tokens(0, start) if _needs_history(req, start) else [],
        num_prompt=len(req.prompt_ids),
    )


PAGES_CLEAN = 1 << 62  # `pages_dirty` when no sent page was re-pointed


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
    # One pass, inlined: at 256 running requests this loop is most of a decode step's serial
    # scheduler time, so the common case (one token, no reset, no capture) makes no calls.
    for req, n in plan.items:
        start = req.computed_len
        num_prompt = len(req.prompt_ids)
        if n == 1 and start >= num_prompt:
            ids.append(req.output_ids[start - num_prompt])  # decode: one token
        else:
            ids.extend(req.tokens(start, n))
        caps = captures.get(req.rid) if captures else None
        if req.table_reset:
            seqs.append(_reset_plan(req, n, caps or [], pages))
            continue
        page_start = min(req.pages_sent, req.pages_dirty)
        num_pages = len(req.pages)
        if page_start < num_pages:
            pages.extend(req.pages[page_start:])
            req.pages_sent = num_pages
            req.pages_dirty = PAGES_CLEAN
        seqs.append(
            SeqPlan(
                req.rid,
                start,
                n,
                req.slots[0],
                req.state_init,
                req.state_src,
                [(c.pos - start, c.slot) for c in caps] if caps else NO_CAPTURES,
                len(req.output_ids),
                False,
                page_start,
                num_pages - page_start,
            )
        )
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
