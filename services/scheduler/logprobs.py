"""The logprobs a request asked for, gathered from the worker's BatchDone for its TokenOuts.

Prompt logprobs come in spans, one per prefill chunk. A request that asks for them is admitted
without a prefix-cache match (cache_client.py: `Admit.use_cache` is off for it), so every
prompt position is computed and has logits; a retracted request computes its prompt again and
the spans it already holds are not taken twice.
"""

from __future__ import annotations

from himamba.common.messages import BatchDone, PromptLogprobs, TokenLogprobs
from himamba.services.scheduler.request import Req


def wants_prompt_logprobs(req: Req) -> bool:
    return req.sampling.prompt_logprobs is not None


def absorb_prompt(req: Req, span: PromptLogprobs) -> None:
    """Keep the part of `span` past what `req` holds (positions 1.. in order)."""
    have = len(req.prompt_logprobs)  # positions 1 .. have
    skip = have + 1 - span.start
    if skip >= 0:
        req.prompt_logprobs.extend(span.entries[skip:])
    else:  # a gap: some positions were not computed; the first token's check reports it
        req.prompt_logprobs_gap = True


def prompt_logprobs_error(req: Req) -> str:
    """Why the request's prompt logprobs cannot be reported ("" when they are complete)."""
    if not wants_prompt_logprobs(req):
        return ""
    if req.prompt_logprobs_gap or len(req.prompt_logprobs) != len(req.prompt_ids) - 1:
        return "internal error: prompt logprobs are incomplete (see the scheduler log)"
    return ""


def token_logprobs(req: Req, done: BatchDone, i: int) -> tuple[list[float] | None, list[TokenLogprobs] | None]:
    """The TokenOut `logprobs` and `top_logprobs` of sequence `i`'s sampled token."""
    lp = done.token_logprobs.get(i)
    if lp is None:
        return None, None
    req.logprobs.append(lp.logprob)
    return [lp.logprob], [lp] if req.sampling.top_logprobs else None


def first_prompt_logprobs(req: Req) -> list[TokenLogprobs] | None:
    """The prompt logprobs, once: with the request's first token."""
    if not wants_prompt_logprobs(req) or req.prompt_logprobs_sent:
        return None
    req.prompt_logprobs_sent = True
    return req.prompt_logprobs
