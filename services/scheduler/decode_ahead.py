"""The next decode step, built while the current one runs, and sent before its results arrive.

At steady decode the next step is the current one again, one token further: the same requests,
each fed the token it just sampled. So while the worker computes step N the scheduler builds step
N+1 (`prebuild`) and sends it at once (`follow`): a RunBatch that `follows` N, whose tokens the
worker fills in from N's results (services/worker/follow_on.py), so it starts N+1 the moment N
ends instead of waiting for the scheduler's round trip. The scheduler then waits for N's tokens
and turns them into outputs, captures into inserts, and so on, while N+1 runs.

Only what N's tokens decide is unknown when N+1 leaves: which requests stop (a stop token). Each
sequence carries its stop tokens (`SeqPlan.stop_ids`: its EOS unless `ignore_eos`, and its
`stop_token_ids`, the token tests of `check_stop`); the worker leaves out of N+1 every sequence
whose token is one of them or whose sampling failed in N, and `ran` reaches the same answer from
the same results. So a request is never finished (its memory released, its state given to the
tree) while a step that still writes it is in flight. Requests that end by length with N's token,
and those leaving (aborted or stopped) when N+1 is sent, are not in it; one that leaves later
runs N+1 and is reaped after it. Anything else that would change step N+1 (an admission, a
missing page or boundary slot, a peer restart) means no prebuilt step, and the scheduler builds
step N+1 the usual way after N's results.
"""

from __future__ import annotations

from typing import NamedTuple

from himamba.common.messages import BatchDone, RunBatch, SeqPlan, Transfer
from himamba.common.wire import IntsFrame
from himamba.services.scheduler import captures, mamba_track
from himamba.services.scheduler.batching import BatchPlan
from himamba.services.scheduler.request import Req
from himamba.services.scheduler.worker_batch import NO_CAPTURES, PAGES_CLEAN


class Ahead(NamedTuple):
    """Step N+1, prebuilt during step N (nothing in it is committed to the requests yet)."""

    plan: BatchPlan
    seqs: list[SeqPlan]
    caps: dict[str, list[captures.Capture]]
    # seq index -> the page-table entries it sends (its `page_start:` slice of `req.pages`)
    page_deltas: dict[int, list[int]]
    ends: frozenset[int]  # seq indices that end by length with step N's token


class Following(NamedTuple):
    """Step N+1 as sent before N's results: its plan (every request that may run it), message,
    frames and captures, and step N's plan (whose tokens it reads)."""

    plan: BatchPlan
    msg: RunBatch
    frames: list[IntsFrame]
    caps: dict[str, list[captures.Capture]]
    follows: BatchPlan


class Ran(NamedTuple):
    """What of a `Following` step the worker runs, once the tokens of the step it follows are in."""

    plan: BatchPlan  # the requests that run it, in batch order
    caps: dict[str, list[captures.Capture]]
    left_out: tuple[str, ...]  # the rids the worker leaves out (BatchDone.left_out), in batch order


def prebuild(
    plan: BatchPlan,
    running: list[Req],
    strategy: mamba_track.Strategy,
    interval: int,
    page_size: int,
    max_context_len: int,
) -> Ahead | None:
    """Step N+1 for decode step `plan` (in flight), or None when it cannot be known yet."""
    if plan.mode != "decode" or len(plan.items) != len(running) or interval < 2:
        return None  # an admission (a prefill comes next) or a track boundary every step
    seqs: list[SeqPlan] = []
    caps: dict[str, list[captures.Capture]] = {}
    deltas: dict[int, list[int]] = {}
    ends: list[int] = []
    for i, (req, _) in enumerate(plan.items):
        if req.status != "running" or req.table_reset:
            return None
        start = req.computed_len + 1  # step N+1 computes the token step N samples
        num_output = len(req.output_ids) + 1
        if len(req.pages) * page_size < start + 1:
            return None  # the overlap window did not get its page: the usual path retracts or waits
        if num_output >= req.max_tokens or len(req.prompt_ids) + num_output >= max_context_len:
            ends.append(i)
        found: list[captures.Capture] = []
        if req.pending_captures or (start + 1) % interval == 0:
            if mamba_track.is_boundary(start + 1, interval) and mamba_track.needs_boundary_slot(req, strategy):
                return None  # its lazy boundary slot is still to be asked for
            found = captures.captures_for(req, "decode", 1, strategy, interval, page_size, start=start)
            if found:
                caps[req.rid] = found
        page_start = min(req.pages_sent, req.pages_dirty)
        num_pages = len(req.pages)
        if page_start < num_pages:
            deltas[i] = req.pages[page_start:]
        else:
            page_start = num_pages
        seqs.append(
            SeqPlan(
                req.rid,
                start,
                1,
                req.slots[0],
                "keep",
                0,
                [(c.pos - start, c.slot) for c in found] if found else NO_CAPTURES,
                num_output,
                False,
                page_start,
                num_pages - page_start,
                stop_ids=req.stop_ids,
            )
        )
    return Ahead(plan, seqs, caps, deltas, frozenset(ends))


def follow(
    ahead: Ahead,
    batch_id: int,
    follows: int,
    leaving: set[str],
    transfers: list[Transfer],
    dropped: list[str],
) -> Following | None:
    """Step N+1 to send now, before step N (batch `follows`) has answered: without the requests
    that end by length with N's token or are `leaving`. None when no request is left."""
    items = ahead.plan.items
    keep = [i for i, (req, _) in enumerate(items) if i not in ahead.ends and req.rid not in leaving]
    if not keep:
        return None
    pages: list[int] = []
    for i in keep:  # the page deltas in seq order, as the worker slices them
        delta = ahead.page_deltas.get(i)
        if delta is not None:
            pages.extend(delta)
            req = items[i][0]
            req.pages_sent = len(req.pages)
            req.pages_dirty = PAGES_CLEAN
    if len(keep) == len(items):
        plan, seqs, caps = ahead.plan, ahead.seqs, ahead.caps
    else:
        plan = BatchPlan("decode", [items[i] for i in keep])
        seqs = [ahead.seqs[i] for i in keep]
        rids = {req.rid for req, _ in plan.items}
        caps = {rid: c for rid, c in ahead.caps.items() if rid in rids}
    pages_f = IntsFrame(pages)
    msg = RunBatch(
        batch_id=batch_id,
        mode="decode",
        seqs=seqs,
        pages=pages_f.ref(0),
        transfers=transfers,
        dropped=dropped,
        follows=follows,
    )
    return Following(plan, msg, [pages_f], caps, ahead.plan)


def ran(sent: Following, done: BatchDone) -> Ran:
    """The requests of `sent` that run it, now that `done` (the step it follows, which did not
    fail as a whole) is in: the others' token stops them, or their sampling failed."""
    tokens = {
        req.rid: t
        for i, ((req, _), t) in enumerate(zip(sent.follows.items, done.next_tokens))
        if i not in done.seq_errors
    }
    keep, left = [], []
    for item, seq in zip(sent.plan.items, sent.msg.seqs, strict=True):
        token = tokens.get(seq.rid)
        if token is None or token in seq.stop_ids:
            left.append(seq.rid)
        else:
            keep.append(item)
    if not left:
        return Ran(sent.plan, sent.caps, ())
    rids = {req.rid for req, _ in keep}
    return Ran(BatchPlan("decode", keep), {rid: c for rid, c in sent.caps.items() if rid in rids}, tuple(left))
