"""Every serving op's Triton twin against its reference on the same device, at the shapes an
8B-class hybrid serves (Nemotron-H-8B's Mamba2 and attention, Qwen3-Next's gated delta rule and
MoE), in float32 and bfloat16. The twins' own cases (tests/kernels/triton_cases.py) are small; these
are where register pressure, int32 offsets and bf16 accumulation show up.

Errors are relative to the reference's norm: float32 twins use IEEE dots (1e-4), bfloat16 inputs
tf32 dots and bf16 rounding of the outputs (3e-2)."""

from __future__ import annotations

import math

import pytest
import torch

from himamba.kernels.reference import attention as ref_attention
from himamba.kernels.reference import conv1d as ref_conv1d
from himamba.kernels.reference import delta_rule as ref_delta
from himamba.kernels.reference import moe as ref_moe
from himamba.kernels.reference import ssd as ref_ssd
from tests.gpu.conftest import tiny

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _twin(name: str):
    import importlib

    return importlib.import_module(f"himamba.kernels.triton.{name}")


# Serving shapes, or rehearsal shapes where every dimension is tiny.
if tiny():
    S = dict(tokens=40, heads=4, head_dim=16, state=16, groups=2, chunk=16, batch=3, conv_dim=64,
             q_heads=4, kv_heads=2, attn_dim=32, context=40, dk=16, dv=16, v_heads=4, k_heads=2,
             experts=8, top_k=2, hidden=32, inter=16)  # fmt: skip
else:
    S = dict(tokens=2048, heads=128, head_dim=64, state=128, groups=8, chunk=128, batch=128, conv_dim=10240,
             q_heads=32, kv_heads=8, attn_dim=128, context=2048, dk=128, dv=128, v_heads=32, k_heads=16,
             experts=512, top_k=10, hidden=2048, inter=512)  # fmt: skip


def rand(*shape: int, seed: int, device, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    got, want = got.float(), want.float()
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    assert err <= TOL[dtype], f"{what}: relative error {err:.2e} > {TOL[dtype]:.0e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ssd_scan_and_state_update(device, dtype):
    L, H, P, N, G, B = S["tokens"], S["heads"], S["head_dim"], S["state"], S["groups"], S["batch"]
    x = rand(1, L, H, P, seed=1, device=device, dtype=dtype)
    dt = rand(1, L, H, seed=2, device=device, dtype=dtype) - 2.0
    A = -torch.exp(rand(H, seed=3, device=device))
    Bm, Cm = rand(1, L, G, N, seed=4, device=device, dtype=dtype), rand(1, L, G, N, seed=5, device=device, dtype=dtype)
    D, dt_bias = rand(H, seed=6, device=device), rand(H, seed=7, device=device)
    init = rand(1, H, P, N, seed=8, device=device)
    args = (x, dt, A, Bm, Cm, S["chunk"])
    kw = dict(D=D, dt_bias=dt_bias, dt_limit=(0.0, math.inf), initial_state=init)
    got, want = _twin("ssd").ssd_scan(*args, **kw), ref_ssd.ssd_scan(*args, **kw)
    close(got.y, want.y, dtype, "ssd_scan y")
    close(got.final_state, want.final_state, dtype, "ssd_scan final state")

    state = rand(B, H, P, N, seed=9, device=device)
    xs, dts = rand(B, H, P, seed=10, device=device, dtype=dtype), rand(B, H, seed=11, device=device, dtype=dtype)
    Bs, Cs = rand(B, G, N, seed=12, device=device, dtype=dtype), rand(B, G, N, seed=13, device=device, dtype=dtype)
    s_got, s_want = state.clone(), state.clone()
    y_got = _twin("ssd").selective_state_update(s_got, xs, dts, A, Bs, Cs, D=D, dt_bias=dt_bias)
    y_want = ref_ssd.selective_state_update(s_want, xs, dts, A, Bs, Cs, D=D, dt_bias=dt_bias)
    close(y_got, y_want, dtype, "selective_state_update y")
    close(s_got, s_want, torch.float32, "selective_state_update state")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_causal_conv1d_and_update(device, dtype):
    L, C, B = S["tokens"], S["conv_dim"], S["batch"]
    x = rand(1, C, L, seed=1, device=device, dtype=dtype)
    w, bias = rand(C, 4, seed=2, device=device, dtype=dtype), rand(C, seed=3, device=device, dtype=dtype)
    init = rand(1, C, 3, seed=4, device=device, dtype=dtype)
    got, want = _twin("conv1d").causal_conv1d(x, w, bias, init), ref_conv1d.causal_conv1d(x, w, bias, init)
    close(got.out, want.out, dtype, "causal_conv1d out")
    close(got.final_state, want.final_state, dtype, "causal_conv1d final state")
    xs, state = rand(B, C, seed=5, device=device, dtype=dtype), rand(B, C, 3, seed=6, device=device, dtype=dtype)
    s_got, s_want = state.clone(), state.clone()
    close(
        _twin("conv1d").causal_conv1d_update(xs, s_got, w, bias),
        ref_conv1d.causal_conv1d_update(xs, s_want, w, bias),
        dtype,
        "causal_conv1d_update out",
    )
    close(s_got, s_want, dtype, "causal_conv1d_update state")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_attention(device, dtype):
    B, ctx, Hq, Hkv, D = S["batch"] // 4 or 1, S["context"], S["q_heads"], S["kv_heads"], S["attn_dim"]
    slots_total = B * ctx + 64
    k_cache = rand(slots_total, Hkv, D, seed=1, device=device, dtype=dtype)
    v_cache = rand(slots_total, Hkv, D, seed=2, device=device, dtype=dtype)
    perm = torch.randperm(slots_total, generator=torch.Generator().manual_seed(3))[: B * ctx]
    table = perm.view(B, ctx).to(device)
    seq_lens = torch.tensor([ctx - 7 * i for i in range(B)], dtype=torch.int64, device=device).clamp_min(1)
    q = rand(B, Hq, D, seed=4, device=device, dtype=dtype)
    scale = D**-0.5
    close(
        _twin("attention").paged_attention_decode(q, k_cache, v_cache, table, seq_lens, scale),
        ref_attention.paged_attention_decode(q, k_cache, v_cache, table, seq_lens, scale),
        dtype,
        "paged_attention_decode",
    )
    new, prefix = ctx // 2, ctx - ctx // 2
    qp = rand(new, Hq, D, seed=5, device=device, dtype=dtype)
    close(
        _twin("attention").paged_attention_prefill(qp, k_cache, v_cache, table[0], prefix, scale),
        ref_attention.paged_attention_prefill(qp, k_cache, v_cache, table[0], prefix, scale),
        dtype,
        "paged_attention_prefill",
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_delta_rule(device, dtype):
    L, Hk, Hv, dk, dv, B = S["tokens"] // 2, S["k_heads"], S["v_heads"], S["dk"], S["dv"], S["batch"] // 4 or 1
    q, k = (
        rand(1, L, Hk, dk, seed=1, device=device, dtype=dtype),
        rand(1, L, Hk, dk, seed=2, device=device, dtype=dtype),
    )
    v = rand(1, L, Hv, dv, seed=3, device=device, dtype=dtype)
    g = -torch.nn.functional.softplus(rand(1, L, Hv, seed=4, device=device)).to(dtype)
    beta = torch.sigmoid(rand(1, L, Hv, seed=5, device=device)).to(dtype)
    init = rand(1, Hv, dk, dv, seed=6, device=device) * 0.1
    got = _twin("delta_rule").chunk_gated_delta_rule(q, k, v, g, beta, initial_state=init)
    want = ref_delta.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=init)
    close(got.out, want.out, dtype, "chunk_gated_delta_rule out")
    close(got.final_state, want.final_state, torch.float32 if dtype == torch.float32 else dtype, "final state")
    qs, ks = rand(B, Hk, dk, seed=7, device=device, dtype=dtype), rand(B, Hk, dk, seed=8, device=device, dtype=dtype)
    vs = rand(B, Hv, dv, seed=9, device=device, dtype=dtype)
    gs = -torch.nn.functional.softplus(rand(B, Hv, seed=10, device=device)).to(dtype)
    bs = torch.sigmoid(rand(B, Hv, seed=11, device=device)).to(dtype)
    state = rand(B, Hv, dk, dv, seed=12, device=device) * 0.1
    s_got, s_want = state.clone(), state.clone()
    close(
        _twin("delta_rule").recurrent_gated_delta_rule_update(qs, ks, vs, gs, bs, s_got),
        ref_delta.recurrent_gated_delta_rule_update(qs, ks, vs, gs, bs, s_want),
        dtype,
        "recurrent_gated_delta_rule_update out",
    )
    close(s_got, s_want, torch.float32, "recurrent_gated_delta_rule_update state")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_moe(device, dtype):
    T, E, k, Hd, I = S["batch"], S["experts"], S["top_k"], S["hidden"], S["inter"]
    logits = rand(T, E, seed=1, device=device)
    routing = ref_moe.moe_route(logits, k, "softmax", True)
    twin_routing = _twin("moe").moe_route(logits, k, "softmax", True)
    torch.testing.assert_close(twin_routing.weights if hasattr(twin_routing, "weights") else twin_routing[0],
                               routing.weights if hasattr(routing, "weights") else routing[0])  # fmt: skip
    x = rand(T, Hd, seed=2, device=device, dtype=dtype)
    gate_up = rand(E, 2 * I, Hd, seed=3, device=device, dtype=dtype) * Hd**-0.5
    down = rand(E, Hd, I, seed=4, device=device, dtype=dtype) * I**-0.5
    close(
        _twin("moe").moe_experts(x, routing, gate_up, down, "silu"),
        ref_moe.moe_experts(x, routing, gate_up, down, "silu"),
        dtype,
        "moe_experts",
    )
