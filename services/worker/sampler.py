"""Sampling: one token per sequence from its last-position logits.

Greedy rows (temperature 0) take the argmax, which breaks ties like transformers does (first
index). The others are sampled as a batch: temperature, top-k, min-p and top-p filters with
per-row parameters, then one inverse-CDF draw per row (the first token whose cumulative
probability passes u * total) with u a function of (seed, step) computed on the host for a seeded
row: a seeded request's tokens do not depend on what else is in the batch, and no row has a
generator of its own. The step reads the device once: the sampled ids with each row's failure code.

Sampling is total per sequence: a row whose logits are not finite (NaN anywhere, or nothing
left to pick) or whose probabilities are not (an infinite logit under a temperature) fails alone
(`Sampled.errors`); its batch-mates still get their tokens. The front door refuses parameters
that would cause this (`SamplingParams.validate`), so a failure here means a model or kernel
fault (tests inject one from outside this module: tests/hostile/fault_site).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import NamedTuple

import torch

from himamba.common.types import SamplingParams
from himamba.kernels.dispatch import cuda_path
from himamba.services.worker.grammar_masks import GrammarMasks
from himamba.services.worker.logit_bias import BiasRows
from himamba.services.worker.penalties import PenaltyState, host_values, penalise_rows


class Sampled(NamedTuple):
    tokens: list[int]  # a failed row's entry is 0 (meaningless)
    errors: dict[int, str] = {}  # row -> why its sampling failed


# Failure codes read back with the tokens.
_NON_FINITE_LOGITS, _NON_FINITE_PROBS = 1, 2
_FAILURES = {
    _NON_FINITE_LOGITS: "sampling failed: the model produced non-finite logits",
    _NON_FINITE_PROBS: "sampling failed: the probabilities are not finite",
}
_M64 = 2**64 - 1
_unseeded = random.Random()  # draws of rows without a seed (seeded from the OS)


def _seed_for(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step * 7_919 + 12_345) % (2**63 - 1)


def _uniform(key: int) -> float:
    """A uniform draw in [0, 1) as a function of `key` alone (splitmix64's finaliser, 53 bits)."""
    z = (key + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return ((z ^ (z >> 31)) >> 11) * 2.0**-53


def _filtered(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, min-p and top-p applied to every row of float32 logits [B, V], each with
    its row's parameters (a greedy row is left at temperature 1, its result unused)."""
    device, vocab = logits.device, logits.shape[1]
    temperature = host_values([p.temperature if p.temperature > 0 else 1.0 for p in params], torch.float32, device)
    logits = logits / temperature.view(-1, 1)
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if max(ks):
        k = host_values(ks, torch.int64, device).view(-1, 1)
        kth = torch.topk(logits, max(ks)).values.gather(1, (k - 1).clamp(min=0))
        kth = kth.masked_fill(k == 0, float("-inf"))  # a row without top-k keeps every token
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if any(p.min_p > 0.0 for p in params):
        min_p = host_values([p.min_p for p in params], torch.float32, device).view(-1, 1)
        logits = logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
        probs = torch.softmax(logits, dim=-1)
    if any(p.top_p < 1.0 for p in params):
        # A row without top-p never drops (its threshold is infinite).
        top_p = host_values([p.top_p if p.top_p < 1.0 else float("inf") for p in params], torch.float32, device)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        cum = sorted_probs.cumsum(dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop_sorted = (cum - sorted_probs) >= top_p.view(-1, 1)
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _non_finite(logits: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """[B] bool: the rows with a NaN (their max is NaN: max propagates it) or no finite logit."""
    bad = top.isnan() | (top == float("-inf"))
    # A row whose max is +inf fails when nothing in it is finite.
    if cuda_path(logits):
        return bad | ((top == float("inf")) & ~torch.isfinite(logits).any(dim=-1))
    # On the CPU a look at the maxima costs no sync and spares a pass over the whole vocabulary.
    rows = [i for i, t in enumerate(top.tolist()) if t == float("inf")]
    if rows:
        bad[rows] |= ~torch.isfinite(logits[rows]).any(dim=-1)
    return bad


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    steps: Sequence[int],
    penalties: Sequence[PenaltyState | None] | None = None,
    grammar: GrammarMasks | None = None,
    bias: BiasRows | None = None,
) -> Sampled:
    """logits: [B, V]. Returns one token per row (logprobs: worker/logprobs.py). `bias` (OpenAI's
    logit_bias, worker/logit_bias.py) is added first, as vLLM does, then rows with a
    PenaltyState get their repetition/frequency/presence penalties; the rows of `grammar`
    (structured outputs) keep only the tokens their grammar allows. A row that cannot be sampled
    is reported in `errors` instead of failing the batch."""
    logits = logits.float()
    errors: dict[int, str] = {}
    if bias is not None:
        logits = bias.apply(logits)
    if penalties is not None:
        logits = penalise_rows(logits, penalties, params)
    if grammar is not None:
        logits = grammar.apply(logits.clone())
        for i, why in grammar.errors.items():
            errors.setdefault(i, why)
    # Each row's max and its first index (the greedy token; ties break as argmax does).
    top, out = logits.max(dim=-1)
    code = _non_finite(logits, top).to(torch.int64) * _NON_FINITE_LOGITS
    if not all(p.temperature == 0.0 for p in params):
        uniforms = [
            _uniform(_seed_for(p.seed, step)) if p.seed is not None else _unseeded.random()
            for p, step in zip(params, steps, strict=True)
        ]
        probs = torch.softmax(_filtered(logits, params), dim=-1)
        # In float64, as torch.multinomial accumulates: no mass lost over a large vocabulary.
        cum = probs.double().cumsum(dim=-1)
        total = cum[:, -1:]
        target = host_values(uniforms, torch.float64, logits.device).view(-1, 1) * total
        # The first token whose cumulative probability passes the target (it has mass of its own).
        drawn = torch.searchsorted(cum, target, right=True).view(-1).clamp(max=logits.shape[1] - 1)
        sampled = host_values([p.temperature != 0.0 for p in params], torch.bool, logits.device)
        out = torch.where(sampled, drawn, out)
        # NaN probabilities (an infinite logit under a temperature) make the total NaN.
        code = torch.where((code == 0) & sampled & total.view(-1).isnan(), _NON_FINITE_PROBS, code)
    # The step's one read of the device: tokens and failure codes together.
    tokens, codes = torch.stack([out, code]).tolist()
    for i, c in enumerate(codes):
        if c:
            errors.setdefault(i, _FAILURES[c])
    for i in errors:
        tokens[i] = 0
    return Sampled(tokens, errors)
