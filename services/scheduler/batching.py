"""Batching policy: which running requests go into the next forward, and how many tokens each.

Continuous batching: every admitted request joins the next decode batch. Prefill is FCFS and
chunked: one prefill forward computes at most `chunk_budget` new tokens in total, so a long
prompt is split across steps. When both prefill and decode work exist, the two kinds of step
alternate, so running decodes keep producing tokens between the chunks of a long prompt.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from himamba.services.scheduler.request import Req


class BatchPlan(NamedTuple):
    mode: Literal["prefill", "decode"]
    items: list[tuple[Req, int]]  # (request, new tokens this step)


def pick_batch(running: list[Req], chunk_budget: int, last_mode: str | None) -> BatchPlan | None:
    # Decode steps extend an existing context by one token; anything else is a prefill.
    prefill: list[Req] = []
    decode: list[Req] = []
    for r in running:
        # `remaining == 1`, inlined: this runs for every running request every step.
        computed = r.computed_len
        if computed > 0 and len(r.prompt_ids) + len(r.output_ids) - computed == 1:
            decode.append(r)
        else:
            prefill.append(r)
    if not prefill and not decode:
        return None
    use_prefill = bool(prefill) and (not decode or last_mode != "prefill")
    if not use_prefill:
        return BatchPlan("decode", [(r, 1) for r in decode])
    items: list[tuple[Req, int]] = []
    budget = chunk_budget
    for r in prefill:  # `running` is in admission order: FCFS
        if budget <= 0:
            break
        n = min(r.remaining, budget)
        items.append((r, n))
        budget -= n
    return BatchPlan("prefill", items)
