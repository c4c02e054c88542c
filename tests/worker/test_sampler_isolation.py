"""The sampler is total per sequence: a row that cannot be sampled fails alone, and its
batch-mates get exactly the tokens they would get without it."""

from __future__ import annotations

import pytest
import torch

from himamba.common.types import SamplingParams
from himamba.services.worker.logprobs import sampled_logprobs
from himamba.services.worker.penalties import PenaltyState
from himamba.services.worker.sampler import sample

V = 64
PARAMS = [
    SamplingParams(),  # greedy
    SamplingParams(temperature=0.8, seed=3),
    SamplingParams(temperature=1.0, top_k=5, top_p=0.9, seed=4, logprobs=True),
    SamplingParams(repetition_penalty=1.3, seed=5, temperature=0.7),
]


def _logits() -> torch.Tensor:
    return torch.randn(len(PARAMS), V, generator=torch.Generator().manual_seed(0)) * 4


def _penalties() -> list[PenaltyState | None]:
    state = PenaltyState(V, num_prompt=2, device=torch.device("cpu"))
    state.feed([1, 2, 3, 2])
    return [None, None, None, state]


@pytest.mark.parametrize(
    "poison",
    [float("nan"), float("inf"), "all-ninf", "one-nan"],
    ids=["nan-row", "inf-row", "no-finite-logit", "one-nan"],
)
@pytest.mark.parametrize("row", range(len(PARAMS)))
def test_a_poisoned_row_fails_alone(row: int, poison: object) -> None:
    clean = sample(_logits(), PARAMS, [7] * len(PARAMS), _penalties())
    assert clean.errors == {}
    bad = _logits()
    if poison == "all-ninf":
        bad[row] = float("-inf")
    elif poison == "one-nan":
        bad[row, 11] = float("nan")
    else:
        bad[row] = poison  # type: ignore[assignment]
    got = sample(bad, PARAMS, [7] * len(PARAMS), _penalties())
    assert set(got.errors) == {row}, got.errors
    assert "sampling failed" in got.errors[row]
    others = [i for i in range(len(PARAMS)) if i != row]
    assert [got.tokens[i] for i in others] == [clean.tokens[i] for i in others]
    got_lp = sampled_logprobs(bad, PARAMS, got.tokens, got.errors)
    clean_lp = sampled_logprobs(_logits(), PARAMS, clean.tokens, clean.errors)
    assert set(clean_lp) == {2}  # the one row that asks for logprobs
    # A failed row reports none; the others' are computed from their own rows only.
    assert got_lp == ({} if row == 2 else clean_lp)


def test_a_clean_batch_has_no_errors() -> None:
    got = sample(_logits(), PARAMS, [0] * len(PARAMS))
    assert got.errors == {} and len(got.tokens) == len(PARAMS)


def test_one_infinite_logit_among_finite_ones_is_picked_not_failed() -> None:
    logits = _logits()
    logits[0, 9] = float("inf")
    logits[0, 30] = float("-inf")
    got = sample(logits, PARAMS, [7] * len(PARAMS), _penalties())
    assert got.errors == {} and got.tokens[0] == 9


def test_greedy_ties_take_the_first_index_over_a_large_vocabulary() -> None:
    # Wide rows are reduced by several threads: the first maximal index must still win.
    logits = torch.zeros(3, 200_000)
    logits[0, [150_000, 70_000, 199_999]] = 1.0
    logits[2, [5, 120_000]] = -0.5
    logits[2] -= 1.0
    got = sample(logits, [SamplingParams()] * 3, [0] * 3)
    assert got.tokens == [70_000, 0, 0] and got.errors == {}


# A seeded request among batch-mates that differ in every way the sampler batches over.
SEEDED = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, min_p=0.02, seed=42, repetition_penalty=1.2)
MATES = [
    SamplingParams(),
    SamplingParams(temperature=1.3, seed=7),
    SamplingParams(temperature=0.5, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.5, frequency_penalty=0.5, seed=9),
    SamplingParams(temperature=0.7, min_p=0.3),
]


def _penalty(params: SamplingParams, history: list[int]) -> PenaltyState | None:
    if not params.penalised:
        return None
    state = PenaltyState(V, num_prompt=2, device=torch.device("cpu"))
    state.feed(history)
    return state


@pytest.mark.parametrize("position", [0, 3, 5])
def test_a_seeded_request_gets_the_same_tokens_alone_and_in_any_batch(position: int) -> None:
    gen = torch.Generator().manual_seed(1)
    alone: list[int] = []
    batched: list[int] = []
    for step in range(12):
        row = torch.randn(V, generator=gen) * 3
        mates = torch.randn(len(MATES), V, generator=gen) * 3
        history = [1, 2, *alone]
        got = sample(row[None], [SEEDED], [step], [_penalty(SEEDED, history)])
        assert got.errors == {}
        alone.append(got.tokens[0])
        logits = torch.cat([mates[:position], row[None], mates[position:]])
        params = [*MATES[:position], SEEDED, *MATES[position:]]
        pens = [_penalty(p, [1, 2, *batched] if p is SEEDED else [3, 4, 5]) for p in params]
        got = sample(logits, params, [step if p is SEEDED else 100 + step for p in params], pens)
        assert got.errors == {}
        batched.append(got.tokens[position])
    assert batched == alone
    assert len(set(alone)) > 1  # it samples, not a constant


def test_the_draw_follows_the_probabilities() -> None:
    # Token i with probability probs[i]: counts over 4000 seeded steps within 4 standard deviations.
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1] + [0.0] * (V - 4))
    logits = probs.log()
    n = 4000
    params = [SamplingParams(temperature=1.0, seed=11)] * n
    got = sample(logits.expand(n, V), params, list(range(n)))
    counts = torch.bincount(torch.tensor(got.tokens), minlength=V).float()
    assert counts[4:].sum() == 0
    sd = (n * probs[:4] * (1 - probs[:4])).sqrt()
    assert ((counts[:4] - n * probs[:4]).abs() <= 4 * sd).all(), counts[:4]


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(temperature=2.0, top_k=3, seed=1), {0, 1, 2}),
        (SamplingParams(temperature=1.0, top_p=0.7, seed=2), {0, 1}),  # 0.4 + 0.3 reach 0.7
        (SamplingParams(temperature=1.0, min_p=0.5, seed=3), {0, 1}),  # 0.3 >= 0.5 * 0.4
    ],
    ids=["top-k", "top-p", "min-p"],
)
def test_each_filter_keeps_exactly_its_tokens(params: SamplingParams, allowed: set[int]) -> None:
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05] + [0.0] * (V - 5))
    n = 400
    greedy_mate = [SamplingParams()] * n  # interleaved greedy rows keep the argmax
    got = sample(
        probs.log().expand(2 * n, V),
        [x for pair in zip([params] * n, greedy_mate, strict=True) for x in pair],
        [s for step in range(n) for s in (step, step)],
    )
    assert set(got.tokens[0::2]) == allowed
    assert set(got.tokens[1::2]) == {0}
