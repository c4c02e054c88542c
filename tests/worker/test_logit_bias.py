"""OpenAI's logit_bias in the sampler: +100 on a token makes greedy decoding pick it, -100 on the
greedy token moves it off; the biases live in static per-row buffers that keep their shape and
addresses whatever the batch (so the add replays inside a CUDA graph)."""

from __future__ import annotations

import pytest
import torch

from himamba.common.types import MAX_LOGIT_BIAS, SamplingParams
from himamba.services.worker.logit_bias import LogitBias
from himamba.services.worker.sampler import sample

V = 64
CPU = torch.device("cpu")


def _logits(rows: int) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(1)) * 5


def test_plus_100_makes_greedy_pick_the_token_and_minus_100_moves_it_off():
    logits = _logits(3)
    greedy = logits.argmax(dim=-1).tolist()
    target = (greedy[0] + 7) % V
    params = [
        SamplingParams(logit_bias={target: 100.0}),
        SamplingParams(logit_bias={greedy[1]: -100.0}),
        SamplingParams(),  # a row without a bias in a biased batch keeps its token
    ]
    bias = LogitBias(rows=4, device=CPU)
    got = sample(logits, params, [0, 0, 0], bias=bias.load(params)).tokens
    second = logits[1].topk(2).indices[1].item()
    assert got == [target, second, greedy[2]]
    # the raw logits (logprobs', return_logits') are untouched
    assert logits.argmax(dim=-1).tolist() == greedy


def test_sampled_rows_follow_the_bias_too():
    logits = _logits(2)
    target = 5
    params = [SamplingParams(temperature=1.0, seed=s, logit_bias={target: 100.0}) for s in (3, 4)]
    assert sample(logits, params, [0, 1], bias=LogitBias(2, CPU).load(params)).tokens == [target, target]


def test_a_grammar_still_wins_over_a_bias():
    """The bias comes before the grammar's mask: a banned token stays banned however biased."""

    class OnlyToken3:
        def __init__(self) -> None:
            self.errors: dict[int, str] = {}

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            keep = torch.full_like(logits, float("-inf"))
            keep[:, 3] = 0
            return logits + keep

    params = [SamplingParams(logit_bias={9: 100.0})]
    got = sample(_logits(1), params, [0], grammar=OnlyToken3(), bias=LogitBias(1, CPU).load(params)).tokens  # type: ignore[arg-type]
    assert got == [3]


def test_the_buffers_are_static_and_stale_rows_are_cleared():
    bias = LogitBias(rows=4, device=CPU)
    ids_ptr, values_ptr = bias.ids.data_ptr(), bias.values.data_ptr()
    full = {t: 1.0 for t in range(MAX_LOGIT_BIAS)}
    first = bias.load([SamplingParams(logit_bias=full), SamplingParams(logit_bias={2: -3.0})])
    assert first is not None and first.ids.shape == (2, MAX_LOGIT_BIAS)
    # the next step: other rows, fewer entries; nothing of the last step's entries may remain
    rows = bias.load([SamplingParams(), SamplingParams(logit_bias={7: 2.5})])
    assert rows is not None
    assert (bias.ids.data_ptr(), bias.values.data_ptr()) == (ids_ptr, values_ptr)
    added = rows.apply(torch.zeros(2, V))
    want = torch.zeros(2, V)
    want[1, 7] = 2.5
    torch.testing.assert_close(added, want)
    assert bias.load([SamplingParams(), SamplingParams()]) is None  # no biased row: nothing is copied


def test_a_batch_larger_than_the_buffers_grows_them():
    bias = LogitBias(rows=1, device=CPU)
    params = [SamplingParams(logit_bias={i: 100.0}) for i in range(3)]
    assert sample(_logits(3), params, [0, 0, 0], bias=bias.load(params)).tokens == [0, 1, 2]


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({1: 100.5}, r"logit_bias\[1\]: 100.5 is out of range \[-100, 100\]"),
        ({1: -101.0}, r"out of range"),
        ({1: float("nan")}, r"out of range"),
        ({-1: 1.0}, r"token id -1 is negative"),
        ({i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}, r"at most 300 tokens, got 301"),
    ],
)
def test_out_of_range_biases_are_refused(bias: dict[int, float], message: str):
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias).validate(max_context_len=100)
    SamplingParams(logit_bias={1: 100.0, 2: -100.0}).validate(max_context_len=100)
