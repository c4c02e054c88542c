"""Decode updates given the whole state pool and `state_batch_indices` (the conv's
`conv_state_indices`): batch row b updates pool row indices[b] in place, every other row stays as it
was, and the result is what the same update of the gathered rows gives. Checked through dispatch on
CPU (the reference; the Triton twins against it: triton_cases.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from himamba.kernels import dispatch

SLOTS = [5, 0, 3]  # shuffled, not consecutive
POOL = 7


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _conv(state: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    x, w, b = _rand(3, 24, seed=1), _rand(24, 4, seed=2), _rand(24, seed=3)
    return dispatch.causal_conv1d_update(x, state, w, b, "silu", conv_state_indices=idx)


def _ssd(state: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    x, dt = _rand(3, 4, 8, seed=1), _rand(3, 4, seed=2)
    A, B, C, D = -_rand(4, seed=3).exp(), _rand(3, 2, 16, seed=4), _rand(3, 2, 16, seed=5), _rand(4, seed=6)
    return dispatch.selective_state_update(state, x, dt, A, B, C, D, _rand(4, seed=7), state_batch_indices=idx)


def _mamba1(state: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    x, dt, z = _rand(3, 12, seed=1), _rand(3, 12, seed=2), _rand(3, 12, seed=3)
    A, B, C = -_rand(12, 16, seed=4).exp(), _rand(3, 16, seed=5), _rand(3, 16, seed=6)
    return dispatch.selective_state_update_mamba1(
        state, x, dt, A, B, C, _rand(12, seed=7), z, _rand(12, seed=8), state_batch_indices=idx
    )


def _delta(state: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    q, k, v = _rand(3, 2, 16, seed=1), _rand(3, 2, 16, seed=2), _rand(3, 4, 8, seed=3)
    g, beta = -_rand(3, 4, seed=4).exp(), _rand(3, 4, seed=5).sigmoid()
    return dispatch.recurrent_gated_delta_rule_update(q, k, v, g, beta, state, state_batch_indices=idx)


OPS: dict[str, tuple[Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor], tuple[int, ...]]] = {
    "conv": (_conv, (24, 3)),
    "ssd": (_ssd, (4, 8, 16)),
    "mamba1": (_mamba1, (12, 16)),
    "delta": (_delta, (4, 16, 8)),
}


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("op", list(OPS))
def test_the_pool_rows_at_the_indices_are_updated_in_place(op: str, dtype: torch.dtype) -> None:
    run, row = OPS[op]
    pool = _rand(POOL, *row, seed=9)
    rows = pool[SLOTS].clone()
    want = run(rows, None)
    before = pool.clone()
    got = run(pool, torch.tensor(SLOTS, dtype=dtype))
    # Without indices a CPU update may run its native kernel: equal up to float32 rounding.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[SLOTS], rows, rtol=1e-5, atol=1e-5)
    others = [s for s in range(POOL) if s not in SLOTS]
    assert torch.equal(pool[others], before[others])


@pytest.mark.parametrize(
    "indices",
    [torch.tensor([5, 0]), torch.tensor([[5, 0, 3]]), torch.tensor([5.0, 0.0, 3.0])],
    ids=["too-few", "two-dims", "float"],
)
@pytest.mark.parametrize("op", list(OPS))
def test_indices_that_do_not_fit_the_batch_are_refused(op: str, indices: torch.Tensor) -> None:
    run, row = OPS[op]
    with pytest.raises(ValueError, match="state_batch_indices must be a \\[3\\] int32/int64 tensor"):
        run(_rand(POOL, *row, seed=9), indices)


@pytest.mark.parametrize("op", list(OPS))
def test_a_pool_of_the_wrong_row_shape_is_refused(op: str) -> None:
    run, row = OPS[op]
    with pytest.raises(ValueError, match="must be"):
        run(_rand(POOL, *row[:-1], row[-1] + 1, seed=9), torch.tensor(SLOTS))
