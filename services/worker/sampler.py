"""Sampling: one token per sequence from its last-position logits.

Greedy rows (temperature 0) take the argmax, which breaks ties like transformers does (first
index). Seeded rows draw from a generator seeded by (seed, step), so a request's tokens do not
depend on what else is in the batch.

Sampling is total per sequence: a row whose logits are not finite (NaN anywhere, or nothing
left to pick) or whose sampling raises fails alone (`Sampled.errors`); its batch-mates still
get their tokens. The front door refuses parameters that would cause this (`SamplingParams.
validate`), so a failure here means a model or kernel fault (tests inject one from outside this
module: tests/hostile/fault_site).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from himamba.common.types import SamplingParams
from himamba.services.worker.grammar_masks import GrammarMasks
from himamba.services.worker.penalties import PenaltyState


class Sampled(NamedTuple):
    tokens: list[int]  # a failed row's entry is 0 (meaningless)
    errors: dict[int, str] = {}  # row -> why its sampling failed


_SAMPLING_ERRORS = (RuntimeError, ValueError, IndexError, OverflowError)


def _seed_for(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step * 7_919 + 12_345) % (2**63 - 1)


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k, top-p and min-p to one row of float32 logits."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.min_p > 0.0:
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = sorted_probs.cumsum(0)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop_sorted = (cum - sorted_probs) >= p.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    steps: Sequence[int],
    penalties: Sequence[PenaltyState | None] | None = None,
    grammar: GrammarMasks | None = None,
) -> Sampled:
    """logits: [B, V]. Returns one token per row (logprobs: worker/logprobs.py). Rows with a
    PenaltyState get their repetition/frequency/presence penalties first; the rows of `grammar`
    (structured outputs) keep only the tokens their grammar allows. A row that cannot be sampled
    is reported in `errors` instead of failing the batch."""
    logits = logits.float()
    errors: dict[int, str] = {}
    if penalties is not None and any(x is not None for x in penalties):
        logits = logits.clone()
        for i, state in enumerate(penalties):
            if state is not None:
                try:
                    logits[i] = state.apply(logits[i], params[i])
                except _SAMPLING_ERRORS as e:
                    errors[i] = f"sampling failed: {type(e).__name__}"
    if grammar is not None:
        logits = grammar.apply(logits.clone())
        for i, why in grammar.errors.items():
            errors.setdefault(i, why)
    # One pass over the logits: each row's max and its first index (the greedy token; ties break
    # as argmax does). A finite max means no NaN (max propagates it) and a finite logit to pick, so
    # only rows whose max is not finite are checked whole: a NaN anywhere, or nothing finite.
    top, out = logits.max(dim=-1)
    odd = torch.nonzero(~torch.isfinite(top)).view(-1)
    if odd.numel():
        rows = logits[odd]
        bad = torch.isnan(rows).any(dim=-1) | ~torch.isfinite(rows).any(dim=-1)
        for i in odd[bad].tolist():
            errors.setdefault(i, "sampling failed: the model produced non-finite logits")
    greedy = [p.temperature == 0.0 for p in params]
    if not all(greedy):
        for i, p in enumerate(params):
            if greedy[i] or i in errors:
                continue
            try:
                row = _filter(logits[i], p)
                probs = torch.softmax(row, dim=-1)
                gen = None
                if p.seed is not None:
                    gen = torch.Generator(device=logits.device).manual_seed(_seed_for(p.seed, steps[i]))
                out[i] = torch.multinomial(probs, 1, generator=gen)[0]
            except _SAMPLING_ERRORS as e:  # torch.multinomial raises RuntimeError on inf/NaN probabilities
                errors[i] = f"sampling failed: {type(e).__name__}"
    if errors:
        out[list(errors)] = 0
    return Sampled(out.tolist(), errors)
