"""The kernels against transformers' PyTorch paths (NemotronH, GraniteMoeHybrid), called as their mixers call them."""

from __future__ import annotations

import pytest
import torch

from himamba.kernels import (
    causal_conv1d,
    causal_conv1d_update,
    gated_rms_norm,
    rms_norm,
    selective_state_update,
    ssd_scan,
)

nemotron = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
granite = pytest.importorskip("transformers.models.granitemoehybrid.modeling_granitemoehybrid")


def test_ssd_scan_matches_mamba2_chunk_scan() -> None:
    g = torch.Generator().manual_seed(0)
    batch, length, heads, head_dim, groups, state_size = 2, 45, 6, 4, 3, 8
    x = torch.randn(batch, length, heads, head_dim, generator=g)
    dt = torch.randn(batch, length, heads, generator=g) - 2.0
    A = -torch.exp(torch.rand(heads, generator=g))
    B = torch.randn(batch, length, groups, state_size, generator=g)
    C = torch.randn(batch, length, groups, state_size, generator=g)
    D = torch.randn(heads, generator=g)
    dt_bias = torch.randn(heads, generator=g)
    init = torch.randn(batch, heads, head_dim, state_size, generator=g)
    limit = (0.1, float("inf"))  # NemotronH's (time_step_min, inf); binds for some tokens here
    want_y, want_state = nemotron.mamba2_chunk_scan(
        x, dt, A, B, C, chunk_size=16, D=D, dt_bias=dt_bias, initial_states=init.clone(),
        dt_softplus=True, dt_limit=limit, return_final_states=True,
    )
    got = ssd_scan(x, dt, A, B, C, 16, D=D, dt_bias=dt_bias, dt_limit=limit, initial_state=init)
    torch.testing.assert_close(got.y, want_y.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.final_state, want_state, rtol=1e-5, atol=1e-5)


def test_selective_state_update_matches_mixer_decode_call() -> None:
    g = torch.Generator().manual_seed(1)
    batch, heads, head_dim, groups, state_size = 3, 4, 5, 2, 6
    state = torch.randn(batch, heads, head_dim, state_size, generator=g)
    x = torch.randn(batch, heads, head_dim, generator=g)
    dt = torch.randn(batch, heads, generator=g)
    A = -torch.exp(torch.rand(heads, generator=g))
    B = torch.randn(batch, groups, state_size, generator=g)
    C = torch.randn(batch, groups, state_size, generator=g)
    D = torch.randn(heads, generator=g)
    dt_bias = torch.randn(heads, generator=g)
    hf_state = state.clone()
    # The mixer expands the per-head parameters over head_dim (and A over the state) before the call.
    want = nemotron.mamba2_selective_state_update(
        hf_state, x, dt[:, :, None].expand(-1, -1, head_dim), A[:, None, None].expand(-1, head_dim, state_size),
        B, C, D[:, None].expand(-1, head_dim), dt_bias=dt_bias[:, None].expand(-1, head_dim), dt_softplus=True,
    )
    got = selective_state_update(state, x, dt, A, B, C, D=D, dt_bias=dt_bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, hf_state, rtol=1e-5, atol=1e-5)


def test_conv_matches_causal_conv1d_fn_and_update() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 10, 9, generator=g)
    weight = torch.randn(10, 4, generator=g)
    bias = torch.randn(10, generator=g)
    got = causal_conv1d(x, weight, bias, None, "silu")
    want_out = nemotron.causal_conv1d_fn(x, weight, bias, activation="silu")
    torch.testing.assert_close(got.out, want_out, rtol=1e-6, atol=1e-6)
    step = torch.randn(2, 10, generator=g)
    hf_state = got.final_state.clone()
    want = nemotron.causal_conv1d_update(step[:, :, None], hf_state, weight, bias, activation="silu")
    state = got.final_state.clone()
    out = causal_conv1d_update(step, state, weight, bias, "silu")
    torch.testing.assert_close(out, want[:, :, 0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state, hf_state, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_match_model_modules(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 32, generator=g).to(dtype)
    gate = torch.randn(5, 32, generator=g).to(dtype)
    weight = torch.randn(32, generator=g).to(dtype)
    with torch.inference_mode():
        nem = nemotron.NemotronHRMSNorm(32, eps=1e-5).to(dtype)
        gra = granite.GraniteMoeHybridRMSNorm(32, eps=1e-5).to(dtype)
        nem_gated = nemotron.NemotronHRMSNormGated(32, group_size=8, eps=1e-5).to(dtype)
        gra_gated = granite.GraniteMoeHybridRMSNormGated(32, group_size=8, eps=1e-5).to(dtype)
        for module in (nem, gra, nem_gated, gra_gated):
            module.weight.copy_(weight)
        assert torch.equal(rms_norm(x, weight, 1e-5, multiply_in_float32=True), nem(x))
        assert torch.equal(rms_norm(x, weight, 1e-5), gra(x))
        assert torch.equal(gated_rms_norm(x, gate, weight, 1e-5, 8), nem_gated(x, gate))
        assert torch.equal(gated_rms_norm(x, gate, weight, 1e-5, 8), gra_gated(x, gate))
        assert torch.equal(gated_rms_norm(x, None, weight, 1e-5, 8), gra_gated(x))


def test_norms_of_prefill_sized_inputs_match_model_modules_to_the_last_bits() -> None:
    """From 32k elements the float32 norms take the mean square from one reduction
    (kernels/reference/norm.py): no longer bit-identical to transformers, within float32 rounding."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(128, 1024, generator=g) * 4.0
    gate = torch.randn(128, 1024, generator=g)
    weight = torch.randn(1024, generator=g)
    with torch.inference_mode():
        nem = nemotron.NemotronHRMSNorm(1024, eps=1e-5)
        nem_gated = nemotron.NemotronHRMSNormGated(1024, group_size=256, eps=1e-5)
        for module in (nem, nem_gated):
            module.weight.copy_(weight)
        torch.testing.assert_close(rms_norm(x, weight, 1e-5, multiply_in_float32=True), nem(x), rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(gated_rms_norm(x, gate, weight, 1e-5, 256), nem_gated(x, gate), rtol=2e-6, atol=2e-6)
