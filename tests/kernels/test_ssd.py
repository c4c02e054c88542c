"""ssd_scan / selective_state_update against the per-token float64 recurrence."""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

from himamba.kernels import ScanResult, selective_state_update, ssd_scan

# Each test runs on the PyTorch reference and on the native CPU kernel (tests/kernels/conftest.py).
pytestmark = pytest.mark.usefixtures("cpu_kernels")

NO_LIMIT = (0.0, math.inf)


class Inputs(NamedTuple):
    x: torch.Tensor  # [Bt, L, H, P]
    dt: torch.Tensor  # [Bt, L, H]
    A: torch.Tensor  # [H]
    B: torch.Tensor  # [Bt, L, G, N]
    C: torch.Tensor
    D: torch.Tensor  # [H]
    dt_bias: torch.Tensor  # [H]
    state: torch.Tensor  # [Bt, H, P, N]


def make(batch: int, length: int, heads: int, head_dim: int, groups: int, state_size: int, seed: int) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    return Inputs(
        x=torch.randn(batch, length, heads, head_dim, generator=g),
        dt=torch.randn(batch, length, heads, generator=g),
        A=-torch.exp(torch.rand(heads, generator=g) * 2.0),
        B=torch.randn(batch, length, groups, state_size, generator=g),
        C=torch.randn(batch, length, groups, state_size, generator=g),
        D=torch.randn(heads, generator=g),
        dt_bias=torch.rand(heads, generator=g) - 0.5,
        state=torch.randn(batch, heads, head_dim, state_size, generator=g),
    )


def tokens(inp: Inputs, start: int, stop: int) -> Inputs:
    """The inputs of tokens start..stop-1 (per-token tensors sliced, parameters kept)."""
    span = slice(start, stop)
    return inp._replace(x=inp.x[:, span], dt=inp.dt[:, span], B=inp.B[:, span], C=inp.C[:, span])


def naive_step_dt(
    dt: torch.Tensor, dt_bias: torch.Tensor | None, softplus: bool, limit: tuple[float, float]
) -> torch.Tensor:
    dt = dt.double()
    if dt_bias is not None:
        dt = dt + dt_bias.double()
    if softplus:
        dt = F.softplus(dt)
    if limit != NO_LIMIT:
        dt = dt.clamp(*limit)
    return dt


def naive_scan(
    inp: Inputs,
    init: torch.Tensor | None,
    use_d: bool = True,
    softplus: bool = True,
    limit: tuple[float, float] = NO_LIMIT,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification, token by token: h = exp(dt A) h + dt x ⊗ B; y = h · C + D x (float64)."""
    batch, length, heads, head_dim = inp.x.shape
    rep = heads // inp.B.shape[2]
    h = torch.zeros(batch, heads, head_dim, inp.B.shape[3], dtype=torch.float64) if init is None else init.double()
    dt = naive_step_dt(inp.dt, inp.dt_bias, softplus, limit)
    A = inp.A.double()
    ys = []
    for t in range(length):
        Bt = inp.B[:, t].double().repeat_interleave(rep, dim=1)  # [Bt, H, N]
        Ct = inp.C[:, t].double().repeat_interleave(rep, dim=1)
        xt = inp.x[:, t].double()  # [Bt, H, P]
        dtt = dt[:, t]  # [Bt, H]
        h = torch.exp(dtt * A)[:, :, None, None] * h + (dtt[:, :, None] * xt)[..., None] * Bt[:, :, None, :]
        y = (h * Ct[:, :, None, :]).sum(-1)
        if use_d:
            y = y + inp.D.double()[:, None] * xt
        ys.append(y)
    return torch.stack(ys, dim=1), h


def run_scan(inp: Inputs, chunk: int, init: torch.Tensor | None, **kwargs: object) -> ScanResult:
    return ssd_scan(
        inp.x, inp.dt, inp.A, inp.B, inp.C, chunk, D=inp.D, dt_bias=inp.dt_bias, initial_state=init, **kwargs
    )


SHAPES = [(1, 2, 4, 1, 8), (2, 4, 3, 2, 5), (2, 6, 2, 3, 4)]  # (Bt, H, P, G, N)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("length", [1, 7, 33, 130])
@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_ssd_scan_matches_recurrence(
    shape: tuple[int, ...], length: int, chunk: int, with_state: bool
) -> None:
    batch, heads, head_dim, groups, state_size = shape
    inp = make(batch, length, heads, head_dim, groups, state_size, seed=length + heads)
    init = inp.state if with_state else None
    before = inp.state.clone()
    result = run_scan(inp, chunk, init)
    want_y, want_h = naive_scan(inp, init)
    assert isinstance(result, ScanResult)
    assert result.y.shape == inp.x.shape and result.y.dtype == torch.float32
    assert result.final_state.dtype == torch.float32
    torch.testing.assert_close(result.y.double(), want_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(result.final_state.double(), want_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(inp.state, before, rtol=0, atol=0)  # the initial state is read only


def test_dt_options_without_softplus_with_limit_and_without_d() -> None:
    inp = make(2, 37, 4, 3, 2, 4, seed=7)
    inp = inp._replace(dt=inp.dt.abs() * 0.5)
    for softplus, limit in [(False, NO_LIMIT), (True, (0.3, 0.9)), (False, (0.1, 0.4))]:
        got = ssd_scan(
            inp.x, inp.dt, inp.A, inp.B, inp.C, 16,
            D=None, dt_bias=inp.dt_bias, dt_softplus=softplus, dt_limit=limit, initial_state=inp.state,
        )
        want_y, want_h = naive_scan(inp, inp.state, use_d=False, softplus=softplus, limit=limit)
        torch.testing.assert_close(got.y.double(), want_y, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.final_state.double(), want_h, rtol=1e-5, atol=1e-5)


def test_dt_limit_changes_the_result() -> None:
    """Guards the clamp branch: a binding limit must not be skipped."""
    inp = make(1, 20, 2, 2, 1, 4, seed=8)
    free = run_scan(inp, 16, None).y
    clamped = run_scan(inp, 16, None, dt_limit=(0.5, 0.6)).y
    assert not torch.allclose(free, clamped)


def test_strong_decay_stays_finite_and_exact() -> None:
    inp = make(1, 130, 4, 2, 2, 4, seed=9)
    inp = inp._replace(A=torch.full((4,), -30.0), dt=inp.dt + 3.0)  # dt*A ~ -100 per token
    result = run_scan(inp, 64, inp.state)
    want_y, want_h = naive_scan(inp, inp.state)
    assert torch.isfinite(result.y).all() and torch.isfinite(result.final_state).all()
    torch.testing.assert_close(result.y.double(), want_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(result.final_state.double(), want_h, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split", [1, 16, 50, 129])
@pytest.mark.parametrize("chunk", [16, 64])
def test_split_equals_whole(split: int, chunk: int) -> None:
    inp = make(2, 130, 4, 3, 2, 5, seed=split)
    whole = run_scan(inp, chunk, inp.state)
    first = run_scan(tokens(inp, 0, split), chunk, inp.state)
    second = run_scan(tokens(inp, split, 130), chunk, first.final_state)
    torch.testing.assert_close(torch.cat([first.y, second.y], dim=1), whole.y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second.final_state, whole.final_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
def test_scan_then_decode_steps_equals_longer_scan(shape: tuple[int, ...]) -> None:
    batch, heads, head_dim, groups, state_size = shape
    prefix, steps = 21, 6
    inp = make(batch, prefix + steps, heads, head_dim, groups, state_size, seed=heads)
    with torch.inference_mode():
        whole = run_scan(inp, 16, inp.state)
        state = run_scan(tokens(inp, 0, prefix), 16, inp.state).final_state.clone()
        ys = []
        for t in range(prefix, prefix + steps):
            ys.append(
                selective_state_update(
                    state, inp.x[:, t], inp.dt[:, t], inp.A, inp.B[:, t], inp.C[:, t], D=inp.D, dt_bias=inp.dt_bias
                )
            )
    torch.testing.assert_close(torch.stack(ys, dim=1), whole.y[:, prefix:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, whole.final_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
def test_selective_state_update_matches_one_step(shape: tuple[int, ...]) -> None:
    batch, heads, head_dim, groups, state_size = shape
    inp = make(batch, 1, heads, head_dim, groups, state_size, seed=2 * heads)
    state = inp.state.clone()
    ptr = state.data_ptr()
    limit = (0.2, 1.5)
    y = selective_state_update(
        state, inp.x[:, 0], inp.dt[:, 0], inp.A, inp.B[:, 0], inp.C[:, 0], D=inp.D, dt_bias=inp.dt_bias, dt_limit=limit
    )
    want_y, want_h = naive_scan(inp, inp.state, limit=limit)
    assert y.shape == (batch, heads, head_dim) and state.data_ptr() == ptr
    torch.testing.assert_close(y.double(), want_y[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.double(), want_h, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["strided_float32", "bfloat16"])
def test_selective_state_update_other_state_layouts(layout: str) -> None:
    """States that cannot be updated in place as float32 take the copy path, with the same result."""
    inp = make(2, 1, 4, 3, 2, 5, seed=21)
    if layout == "strided_float32":
        state = inp.state.transpose(-1, -2).contiguous().transpose(-1, -2)
        assert not state.is_contiguous()
        start, tol = inp.state, 1e-5
    else:
        state = inp.state.bfloat16()
        start, tol = state.float(), 1e-2
    y = selective_state_update(
        state, inp.x[:, 0], inp.dt[:, 0], inp.A, inp.B[:, 0], inp.C[:, 0], D=inp.D, dt_bias=inp.dt_bias
    )
    want_y, want_h = naive_scan(inp, start)
    torch.testing.assert_close(y.double(), want_y[:, 0], rtol=1e-5, atol=1e-5)  # read before rounding
    torch.testing.assert_close(state.double(), want_h, rtol=tol, atol=tol)


def test_strided_views_of_one_projection_are_accepted() -> None:
    """The mixer passes x, B, C, dt as column slices of one projection; L is a multiple of the chunk."""
    batch, length, heads, head_dim, groups, state_size = 2, 32, 4, 3, 2, 5
    widths = [heads * head_dim, groups * state_size, groups * state_size, heads]
    proj = torch.randn(batch, length, sum(widths), generator=torch.Generator().manual_seed(31))
    x, b, c, dt = proj.split(widths, dim=-1)
    inp = make(batch, length, heads, head_dim, groups, state_size, seed=31)
    inp = inp._replace(
        x=x.view(batch, length, heads, head_dim),
        B=b.view(batch, length, groups, state_size),
        C=c.view(batch, length, groups, state_size),
        dt=dt,
    )
    assert not inp.x.is_contiguous() and not inp.dt.is_contiguous()
    result = run_scan(inp, 16, inp.state)
    want_y, want_h = naive_scan(inp, inp.state)
    torch.testing.assert_close(result.y.double(), want_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(result.final_state.double(), want_h, rtol=1e-5, atol=1e-5)
    state = inp.state.clone()
    y = selective_state_update(
        state, inp.x[:, 0], inp.dt[:, 0], inp.A, inp.B[:, 0], inp.C[:, 0], D=inp.D, dt_bias=inp.dt_bias
    )
    torch.testing.assert_close(y, run_scan(tokens(inp, 0, 1), 16, inp.state).y[:, 0], rtol=1e-5, atol=1e-5)


def test_bfloat16_inputs_keep_dtypes() -> None:
    inp = make(2, 40, 4, 4, 2, 8, seed=12)
    low = Inputs(*(t.bfloat16() for t in inp))
    result = ssd_scan(low.x, low.dt, inp.A, low.B, low.C, 16, D=inp.D, dt_bias=inp.dt_bias)
    assert result.y.dtype == torch.bfloat16 and result.final_state.dtype == torch.float32
    want_y, _ = naive_scan(Inputs(*(t.double() for t in low))._replace(A=inp.A, D=inp.D, dt_bias=inp.dt_bias), None)
    torch.testing.assert_close(result.y.double(), want_y, rtol=2e-2, atol=2e-2)
    given = run_scan(inp, 16, inp.state.bfloat16())
    assert given.final_state.dtype == torch.bfloat16
    state = inp.state.bfloat16()
    y = selective_state_update(state, low.x[:, 0], low.dt[:, 0], inp.A, low.B[:, 0], low.C[:, 0], D=inp.D)
    assert y.dtype == torch.bfloat16 and state.dtype == torch.bfloat16


def test_empty_segment_returns_initial_state() -> None:
    inp = make(1, 0, 2, 2, 1, 3, seed=1)
    result = run_scan(inp, 16, inp.state)
    assert result.y.shape == (1, 0, 2, 2)
    torch.testing.assert_close(result.final_state, inp.state, rtol=0, atol=0)
    assert result.final_state.data_ptr() != inp.state.data_ptr()


def test_bad_input_raises_value_error() -> None:
    inp = make(1, 5, 4, 2, 2, 3, seed=1)
    with pytest.raises(ValueError, match="groups"):
        ssd_scan(inp.x, inp.dt, inp.A, inp.B[:, :, :1].expand(1, 5, 3, 3), inp.C[:, :, :1].expand(1, 5, 3, 3), 16)
    with pytest.raises(ValueError, match="chunk_size"):
        ssd_scan(inp.x, inp.dt, inp.A, inp.B, inp.C, 0)
    with pytest.raises(ValueError, match="dt must"):
        ssd_scan(inp.x, inp.dt[:, :4], inp.A, inp.B, inp.C, 16)
    with pytest.raises(ValueError, match="initial_state"):
        ssd_scan(inp.x, inp.dt, inp.A, inp.B, inp.C, 16, initial_state=inp.state[:, :2])
    with pytest.raises(ValueError, match="dt_limit"):
        ssd_scan(inp.x, inp.dt, inp.A, inp.B, inp.C, 16, dt_limit=(1.0, 0.5))
    with pytest.raises(ValueError, match="D must"):
        ssd_scan(inp.x, inp.dt, inp.A, inp.B, inp.C, 16, D=inp.D[:3])
    with pytest.raises(ValueError, match="state must"):
        selective_state_update(inp.state[:, :, :1], inp.x[:, 0], inp.dt[:, 0], inp.A, inp.B[:, 0], inp.C[:, 0])
