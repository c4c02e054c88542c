"""selective_scan / selective_state_update_mamba1 (Mamba1) against a per-token float64 specification
and against transformers' Jamba torch functions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from himamba.kernels import ScanResult, selective_scan, selective_state_update_mamba1
from himamba.kernels.reference import selective_scan as scan_module

TOL = {"rtol": 1e-5, "atol": 1e-5}


def naive_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    delta_bias: torch.Tensor | None,
    softplus: bool,
    state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification, in float64, one token at a time:
    h = exp(dt A) h + dt u B;  y = (h·C + D u) * silu(z)."""
    batch, length, channels = u.shape
    u, delta, A, B, C = (t.double() for t in (u, delta, A, B, C))
    dt = delta if delta_bias is None else delta + delta_bias.double()
    if softplus:
        dt = torch.log1p(torch.exp(dt))
    h = torch.zeros(batch, channels, A.shape[1], dtype=torch.float64) if state is None else state.double().clone()
    y = torch.zeros(batch, length, channels, dtype=torch.float64)
    for t in range(length):
        h = torch.exp(dt[:, t, :, None] * A) * h + (dt[:, t] * u[:, t])[:, :, None] * B[:, t, None, :]
        y[:, t] = (h * C[:, t, None, :]).sum(-1)
    if D is not None:
        y = y + D.double() * u
    if z is not None:
        y = y * F.silu(z.double())
    return y, h


def make(batch: int, length: int, channels: int, state_size: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "u": torch.randn(batch, length, channels, generator=gen),
        "delta": torch.randn(batch, length, channels, generator=gen) - 1.0,
        "A": -torch.exp(torch.rand(channels, state_size, generator=gen) * 2),
        "B": torch.randn(batch, length, state_size, generator=gen),
        "C": torch.randn(batch, length, state_size, generator=gen),
        "D": torch.randn(channels, generator=gen),
        "z": torch.randn(batch, length, channels, generator=gen),
        "delta_bias": torch.randn(channels, generator=gen),
        "state": torch.randn(batch, channels, state_size, generator=gen),
    }


def run(t: dict[str, torch.Tensor], init: torch.Tensor | None, full: bool = True, softplus: bool = True) -> ScanResult:
    extras = (t["D"], t["z"], t["delta_bias"]) if full else (None, None, None)
    return selective_scan(t["u"], t["delta"], t["A"], t["B"], t["C"], *extras, softplus, init)


def spec(t: dict[str, torch.Tensor], init: torch.Tensor | None, full: bool = True, softplus: bool = True):
    extras = (t["D"], t["z"], t["delta_bias"]) if full else (None, None, None)
    return naive_scan(t["u"], t["delta"], t["A"], t["B"], t["C"], *extras, softplus, init)


@pytest.fixture(params=["loop", "chunked"])
def form(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Force one of the two scan forms for every length >= 2 (they are picked by size otherwise)."""
    limit = 0 if request.param == "loop" else 1 << 40
    monkeypatch.setattr(scan_module, "_CHUNKED_MAX_STEP_ELEMENTS", limit)
    monkeypatch.setattr(scan_module, "_CHUNKED_MIN_LEN", 2)
    return request.param


@pytest.mark.parametrize("batch,channels,state_size", [(1, 4, 3), (2, 12, 5)])
@pytest.mark.parametrize("length", [1, 7, 33, 130])
@pytest.mark.parametrize("with_state", [False, True])
def test_both_forms_match_spec(
    form: str, batch: int, channels: int, state_size: int, length: int, with_state: bool
) -> None:
    t = make(batch, length, channels, state_size, seed=length + channels)
    init = t["state"] if with_state else None
    result = run(t, init)
    want_y, want_state = spec(t, init)
    assert isinstance(result, ScanResult)
    assert result.y.shape == (batch, length, channels) and result.y.dtype == torch.float32
    assert result.final_state.shape == (batch, channels, state_size) and result.final_state.dtype == torch.float32
    torch.testing.assert_close(result.y.double(), want_y, **TOL)
    torch.testing.assert_close(result.final_state.double(), want_state, **TOL)


@pytest.mark.parametrize("softplus", [False, True])
def test_without_skip_gate_or_bias(softplus: bool) -> None:
    t = make(2, 70, 6, 4, seed=3)
    t["delta"] = t["delta"].abs() * 0.3 if not softplus else t["delta"]  # raw dt must be >= 0
    result = run(t, t["state"], full=False, softplus=softplus)
    want_y, want_state = spec(t, t["state"], full=False, softplus=softplus)
    torch.testing.assert_close(result.y.double(), want_y, **TOL)
    torch.testing.assert_close(result.final_state.double(), want_state, **TOL)


def test_default_choice_on_a_wide_state_matches_spec() -> None:
    """Bt*D*N above the chunked form's limit: the default choice (the loop) on a realistic width."""
    t = make(1, 70, 640, 16, seed=4)
    assert t["state"].numel() > scan_module._CHUNKED_MAX_STEP_ELEMENTS
    result = run(t, t["state"])
    want_y, want_state = spec(t, t["state"])
    torch.testing.assert_close(result.y.double(), want_y, **TOL)
    torch.testing.assert_close(result.final_state.double(), want_state, **TOL)


@pytest.mark.parametrize("split", [1, 40, 99, 129])
def test_split_equals_whole(split: int) -> None:
    t = make(2, 130, 8, 4, seed=split)
    whole = run(t, t["state"])
    seq_keys = ("u", "delta", "B", "C", "z")
    first = run({**t, **{n: t[n][:, :split] for n in seq_keys}}, t["state"])
    second = run({**t, **{n: t[n][:, split:] for n in seq_keys}}, first.final_state)
    torch.testing.assert_close(torch.cat([first.y, second.y], dim=1), whole.y, **TOL)
    torch.testing.assert_close(second.final_state, whole.final_state, **TOL)


def test_prefill_then_decode_steps_equals_longer_prefill() -> None:
    t = make(3, 72, 8, 4, seed=5)
    whole = run(t, None)
    prefix = 66
    first = run({**t, **{n: t[n][:, :prefix] for n in ("u", "delta", "B", "C", "z")}}, None)
    state = first.final_state.clone()
    ptr = state.data_ptr()
    with torch.inference_mode():
        ys = [
            selective_state_update_mamba1(
                state,
                t["u"][:, i],
                t["delta"][:, i],
                t["A"],
                t["B"][:, i],
                t["C"][:, i],
                t["D"],
                t["z"][:, i],
                t["delta_bias"],
                True,
            )
            for i in range(prefix, 72)
        ]
    assert state.data_ptr() == ptr
    torch.testing.assert_close(torch.stack(ys, dim=1), whole.y[:, prefix:], **TOL)
    torch.testing.assert_close(state, whole.final_state, **TOL)


def test_update_matches_spec_without_optional_inputs() -> None:
    t = make(2, 1, 6, 4, seed=6)
    state = t["state"].clone()
    t["delta"] = t["delta"].abs()
    y = selective_state_update_mamba1(
        state, t["u"][:, 0], t["delta"][:, 0], t["A"], t["B"][:, 0], t["C"][:, 0], dt_softplus=False
    )
    want_y, want_state = spec(t, t["state"], full=False, softplus=False)
    torch.testing.assert_close(y.double(), want_y[:, 0], **TOL)
    torch.testing.assert_close(state.double(), want_state, **TOL)


def test_initial_state_is_not_modified_and_empty_segment_keeps_it() -> None:
    t = make(2, 80, 4, 3, seed=7)
    init = t["state"].clone()
    run(t, init)
    torch.testing.assert_close(init, t["state"], rtol=0, atol=0)
    empty = run({**t, **{n: t[n][:, :0] for n in ("u", "delta", "B", "C", "z")}}, init)
    assert empty.y.shape == (2, 0, 4)
    torch.testing.assert_close(empty.final_state, init, rtol=0, atol=0)


def test_bfloat16_inputs_and_state() -> None:
    t = make(2, 70, 8, 4, seed=8)
    bf = {n: x.bfloat16() for n, x in t.items()}
    result = run(bf, bf["state"])
    assert result.y.dtype == torch.bfloat16 and result.final_state.dtype == torch.bfloat16
    want_y, _ = spec(bf, bf["state"])
    torch.testing.assert_close(result.y.double(), want_y, rtol=5e-2, atol=5e-2)
    state = bf["state"].clone()
    y = selective_state_update_mamba1(state, bf["u"][:, 0], bf["delta"][:, 0], bf["A"], bf["B"][:, 0], bf["C"][:, 0])
    assert y.dtype == torch.bfloat16 and state.dtype == torch.bfloat16


def test_bad_input_raises_value_error() -> None:
    t = make(2, 5, 4, 3, seed=9)
    u, delta, A, B, C = (t[n] for n in ("u", "delta", "A", "B", "C"))
    with pytest.raises(ValueError, match="u must"):
        selective_scan(u[0], delta, A, B, C)
    with pytest.raises(ValueError, match="delta"):
        selective_scan(u, delta[:, :2], A, B, C)
    with pytest.raises(ValueError, match="A must"):
        selective_scan(u, delta, A[:2], B, C)
    with pytest.raises(ValueError, match="C must"):
        selective_scan(u, delta, A, B, C[:, :, :2])
    with pytest.raises(ValueError, match="delta_bias"):
        selective_scan(u, delta, A, B, C, delta_bias=t["delta_bias"][:2])
    with pytest.raises(ValueError, match="initial_state"):
        selective_scan(u, delta, A, B, C, initial_state=t["state"][:1])
    with pytest.raises(ValueError, match="state must"):
        selective_state_update_mamba1(t["state"][:1], u[:, 0], delta[:, 0], A, B[:, 0], C[:, 0])
    with pytest.raises(ValueError, match="z must"):
        selective_state_update_mamba1(t["state"], u[:, 0], delta[:, 0], A, B[:, 0], C[:, 0], z=u[:1, 0])


@pytest.mark.parametrize("channels", [12, 640])  # the chunked form and the loop, by default choice
def test_matches_transformers_jamba(channels: int) -> None:
    jamba = pytest.importorskip("transformers.models.jamba.modeling_jamba")
    t = make(2, 70, channels, 16, seed=10)
    # transformers' Mamba1 code is channel-major: u, delta, z [Bt, D, L]; B, C [Bt, N, L].
    cm = {n: t[n].transpose(1, 2) for n in ("u", "delta", "B", "C", "z")}
    want_y, want_state = jamba.mamba_selective_scan(
        cm["u"],
        cm["delta"],
        t["A"],
        cm["B"],
        cm["C"],
        D=t["D"],
        z=cm["z"],
        delta_bias=t["delta_bias"],
        delta_softplus=True,
        return_last_state=True,
    )
    got = run(t, None)
    torch.testing.assert_close(got.y, want_y.transpose(1, 2), **TOL)
    torch.testing.assert_close(got.final_state, want_state, **TOL)
    # The decode call as JambaMambaMixer makes it.
    hf_state = got.final_state.clone()
    state = got.final_state.clone()
    step = make(2, 1, channels, 16, seed=11)
    want = jamba.mamba_selective_state_update(
        hf_state,
        step["u"][:, 0],
        step["delta"][:, 0],
        t["A"],
        step["B"][:, 0],
        step["C"][:, 0],
        t["D"],
        dt_bias=t["delta_bias"],
        dt_softplus=True,
        z=step["z"][:, 0],
    )
    y = selective_state_update_mamba1(
        state,
        step["u"][:, 0],
        step["delta"][:, 0],
        t["A"],
        step["B"][:, 0],
        step["C"][:, 0],
        t["D"],
        step["z"][:, 0],
        t["delta_bias"],
        True,
    )
    torch.testing.assert_close(y, want, **TOL)
    torch.testing.assert_close(state, hf_state, **TOL)
