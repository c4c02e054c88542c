"""The next decode step, built while the current one runs, and sent the moment its results arrive.

At steady decode the next step is the current one again, one token further: the same requests,
each fed the token it just sampled. So while the worker computes step N the scheduler builds step
N+1's plans (`prebuild`), and when N's BatchDone arrives it sends N+1 at once (`continue_with`)
and only then turns N's tokens into outputs, captures into inserts, and so on. The worker's
idle time between two forwards is then the wake-up and one send, not the per-request work.

Only what N's tokens decide is left for the moment they arrive: which requests stop (a stop
token, checked exactly by `check_stop`; lengths, aborts and failed sequences are known before).
Those leave step N+1 before it is sent, so a request is never finished (its memory released,
its state given to the tree) while a step that still writes it is in flight. Anything else that
would change step N+1 (an admission, a missing page or boundary slot, a peer restart) means no
prebuilt step, and the scheduler builds step N+1 the usual way after N's results.
"""

from __future__ import annotations

from typing import NamedTuple

from himamba.common.messages import BatchDone, RunBatch, SeqPlan, Transfer
from himamba.common.wire import IntsFrame
from himamba.services.scheduler import captures, mamba_track
from himamba.services.scheduler.batching import BatchPlan
from himamba.services.scheduler.request import Req
from himamba.services.scheduler.stop import check_stop
from himamba.services.scheduler.worker_batch import NO_CAPTURES, PAGES_CLEAN


class Ahead(NamedTuple):
    """Step N+1, prebuilt during step N (nothing in it is committed to the requests yet)."""

    plan: BatchPlan
    seqs: list[SeqPlan]
    caps: dict[str, list[captures.Capture]]
    # seq index -> the page-table entries it sends (its `page_start:` slice of `req.pages`)
    page_deltas: dict[int, list[int]]
    stop_ids: frozenset[int]  # every token that may stop one of the requests
    ends: frozenset[int]  # seq indices that end by length with step N's token


class Continued(NamedTuple):
    """Step N+1 as sent: its plan, message and frames, and the requests N's tokens removed."""

    plan: BatchPlan
    msg: RunBatch
    frames: list[IntsFrame]
    caps: dict[str, list[captures.Capture]]
    left: frozenset[int]  # indices into the prebuilt plan of the requests that are not in it


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
    stop_sets: dict[int, frozenset[int]] = {}
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
        sampling = req.sampling
        if not sampling.ignore_eos and req.eos_ids:
            stop_sets[id(req.eos_ids)] = req.eos_ids
        if sampling.stop_token_ids:
            stop_sets[id(sampling.stop_token_ids)] = frozenset(sampling.stop_token_ids)
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
            )
        )
    stop_ids = frozenset().union(*stop_sets.values()) if stop_sets else frozenset()
    return Ahead(plan, seqs, caps, deltas, stop_ids, frozenset(ends))


def continue_with(
    ahead: Ahead,
    done: BatchDone,
    batch_id: int,
    leaving: set[str],
    max_context_len: int,
    transfers: list[Transfer],
    dropped: list[str],
) -> Continued | None:
    """Step N+1 now that step N's tokens are in: without the requests that stop with them, that
    failed, or that are `leaving` (aborted or stopped since). None when step N failed."""
    if done.error or len(done.next_tokens) != len(ahead.seqs):
        return None
    tokens = done.next_tokens
    left = set(ahead.ends)
    if done.seq_errors:
        left.update(done.seq_errors)
    items = ahead.plan.items
    if leaving:
        left.update(i for i, (req, _) in enumerate(items) if req.rid in leaving)
    if ahead.stop_ids and not ahead.stop_ids.isdisjoint(tokens):
        for i, token in enumerate(tokens):
            if token in ahead.stop_ids:
                req = items[i][0]
                num_output = len(req.output_ids) + 1
                if check_stop(req, token, num_output, len(req.prompt_ids) + num_output, max_context_len):
                    left.add(i)
    if left:
        keep = [i for i in range(len(items)) if i not in left]
        if not keep:
            return None
        plan = BatchPlan("decode", [items[i] for i in keep])
        seqs = [ahead.seqs[i] for i in keep]
        ids = [tokens[i] for i in keep]
        caps = {rid: c for rid, c in ahead.caps.items() if not any(items[i][0].rid == rid for i in left)}
    else:
        plan, seqs, ids, caps = ahead.plan, ahead.seqs, tokens, ahead.caps
    pages: list[int] = []
    for i, delta in ahead.page_deltas.items():  # dict order is seq order
        if i not in left:
            pages.extend(delta)
            req = items[i][0]
            req.pages_sent = len(req.pages)
            req.pages_dirty = PAGES_CLEAN
    ids_f, pages_f = IntsFrame(ids), IntsFrame(pages)
    msg = RunBatch(
        batch_id=batch_id,
        mode="decode",
        seqs=seqs,
        input_ids=ids_f.ref(0),
        pages=pages_f.ref(1),
        transfers=transfers,
        dropped=dropped,
    )
    return Continued(plan, msg, [ids_f, pages_f], caps, frozenset(left))
