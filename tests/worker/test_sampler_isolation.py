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
