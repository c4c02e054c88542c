"""Every op runs unchanged on CUDA tensors and agrees with its CPU result (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from himamba.kernels import (
    causal_conv1d,
    causal_conv1d_update,
    chunk_gated_delta_rule,
    gated_rms_norm,
    moe_experts,
    moe_route,
    paged_attention_decode,
    paged_attention_prefill,
    recurrent_gated_delta_rule_update,
    rms_norm,
    selective_scan,
    selective_state_update,
    selective_state_update_mamba1,
    ssd_scan,
    write_kv,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
TOL = {"rtol": 1e-4, "atol": 1e-4}


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_conv_on_cuda() -> None:
    x, weight, bias, state = rand(2, 8, 11, seed=1), rand(8, 4, seed=2), rand(8, seed=3), rand(2, 8, 3, seed=4)
    cpu = causal_conv1d(x, weight, bias, state)
    gpu = causal_conv1d(x.to(CUDA), weight.to(CUDA), bias.to(CUDA), state.to(CUDA))
    torch.testing.assert_close(gpu.out.cpu(), cpu.out, **TOL)
    torch.testing.assert_close(gpu.final_state.cpu(), cpu.final_state, **TOL)
    conv_state = state.to(CUDA)
    out = causal_conv1d_update(x[:, :, 0].to(CUDA), conv_state, weight.to(CUDA), bias.to(CUDA))
    cpu_state = state.clone()
    torch.testing.assert_close(out.cpu(), causal_conv1d_update(x[:, :, 0], cpu_state, weight, bias), **TOL)
    torch.testing.assert_close(conv_state.cpu(), cpu_state, **TOL)


def test_ssd_on_cuda() -> None:
    batch, length, heads, head_dim, groups, state_size = 2, 70, 4, 8, 2, 16
    x = rand(batch, length, heads, head_dim, seed=1)
    dt = rand(batch, length, heads, seed=2)
    A = -torch.exp(rand(heads, seed=3))
    B, C = rand(batch, length, groups, state_size, seed=4), rand(batch, length, groups, state_size, seed=5)
    D, dt_bias = rand(heads, seed=6), rand(heads, seed=7)
    init = rand(batch, heads, head_dim, state_size, seed=8)
    cpu = ssd_scan(x, dt, A, B, C, 32, D=D, dt_bias=dt_bias, dt_limit=(0.01, 5.0), initial_state=init)
    args = [t.to(CUDA) for t in (x, dt, A, B, C)]
    gpu = ssd_scan(*args, 32, D=D.to(CUDA), dt_bias=dt_bias.to(CUDA), dt_limit=(0.01, 5.0), initial_state=init.to(CUDA))
    torch.testing.assert_close(gpu.y.cpu(), cpu.y, **TOL)
    torch.testing.assert_close(gpu.final_state.cpu(), cpu.final_state, **TOL)
    state = cpu.final_state.clone()
    gpu_state = gpu.final_state.clone()
    y = selective_state_update(state, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D=D, dt_bias=dt_bias)
    step = [t.to(CUDA) for t in (x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0])]
    gy = selective_state_update(gpu_state, *step, D=D.to(CUDA), dt_bias=dt_bias.to(CUDA))
    torch.testing.assert_close(gy.cpu(), y, **TOL)
    torch.testing.assert_close(gpu_state.cpu(), state, **TOL)


def test_norms_on_cuda() -> None:
    x, gate, weight = rand(6, 64, seed=1), rand(6, 64, seed=2), rand(64, seed=3)
    torch.testing.assert_close(rms_norm(x.to(CUDA), weight.to(CUDA), 1e-5).cpu(), rms_norm(x, weight, 1e-5), **TOL)
    gpu = gated_rms_norm(x.to(CUDA), gate.to(CUDA), weight.to(CUDA), 1e-5, 16)
    torch.testing.assert_close(gpu.cpu(), gated_rms_norm(x, gate, weight, 1e-5, 16), **TOL)


def test_paged_attention_on_cuda() -> None:
    k_cache, v_cache = rand(200, 2, 64, seed=1), rand(200, 2, 64, seed=2)
    slots = torch.randperm(200, generator=torch.Generator().manual_seed(3))[:40]
    q = rand(10, 8, 64, seed=4)
    new_k, new_v = rand(10, 2, 64, seed=5), rand(10, 2, 64, seed=6)
    gk, gv = k_cache.to(CUDA), v_cache.to(CUDA)
    write_kv(k_cache, v_cache, slots[30:], new_k, new_v)
    write_kv(gk, gv, slots[30:].to(CUDA), new_k.to(CUDA), new_v.to(CUDA))
    cpu = paged_attention_prefill(q, k_cache, v_cache, slots, 30, 0.125)
    gpu = paged_attention_prefill(q.to(CUDA), gk, gv, slots.to(CUDA), 30, 0.125)
    torch.testing.assert_close(gpu.cpu(), cpu, **TOL)
    table, lens = slots.view(4, 10), torch.tensor([10, 3, 7, 1])
    cpu = paged_attention_decode(q[:4], k_cache, v_cache, table, lens, 0.125)
    gpu = paged_attention_decode(q[:4].to(CUDA), gk, gv, table.to(CUDA), lens.to(CUDA), 0.125)
    torch.testing.assert_close(gpu.cpu(), cpu, **TOL)


def test_gated_delta_rule_on_cuda() -> None:
    q, k = rand(2, 70, 2, 16, seed=1), rand(2, 70, 2, 16, seed=2)
    v = rand(2, 70, 4, 8, seed=3)
    g, beta = -rand(2, 70, 4, seed=4).abs(), rand(2, 70, 4, seed=5).sigmoid()
    init = rand(2, 4, 16, 8, seed=6)
    cpu = chunk_gated_delta_rule(q, k, v, g, beta, 32, init)
    gpu = chunk_gated_delta_rule(*(t.to(CUDA) for t in (q, k, v, g, beta)), 32, init.to(CUDA))
    torch.testing.assert_close(gpu.out.cpu(), cpu.out, **TOL)
    torch.testing.assert_close(gpu.final_state.cpu(), cpu.final_state, **TOL)
    state, gpu_state = cpu.final_state.clone(), gpu.final_state.clone()
    out = recurrent_gated_delta_rule_update(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
    gout = recurrent_gated_delta_rule_update(*(t[:, 0].to(CUDA) for t in (q, k, v, g, beta)), gpu_state)
    torch.testing.assert_close(gout.cpu(), out, **TOL)
    torch.testing.assert_close(gpu_state.cpu(), state, **TOL)


@pytest.mark.parametrize("channels", [8, 1024])  # chunked form and loop
def test_selective_scan_on_cuda(channels: int) -> None:
    u, delta, z = rand(2, 70, channels, seed=1), rand(2, 70, channels, seed=2), rand(2, 70, channels, seed=3)
    A = -torch.exp(rand(channels, 16, seed=4))
    B, C = rand(2, 70, 16, seed=5), rand(2, 70, 16, seed=6)
    D, bias = rand(channels, seed=7), rand(channels, seed=8)
    cpu = selective_scan(u, delta, A, B, C, D, z, bias)
    gpu = selective_scan(*(t.to(CUDA) for t in (u, delta, A, B, C, D, z, bias)))
    torch.testing.assert_close(gpu.y.cpu(), cpu.y, **TOL)
    torch.testing.assert_close(gpu.final_state.cpu(), cpu.final_state, **TOL)
    state, gpu_state = cpu.final_state.clone(), gpu.final_state.clone()
    y = selective_state_update_mamba1(state, u[:, 0], delta[:, 0], A, B[:, 0], C[:, 0], D, z[:, 0], bias)
    step = (u[:, 0], delta[:, 0], A, B[:, 0], C[:, 0], D, z[:, 0], bias)
    gy = selective_state_update_mamba1(gpu_state, *(t.to(CUDA) for t in step))
    torch.testing.assert_close(gy.cpu(), y, **TOL)
    torch.testing.assert_close(gpu_state.cpu(), state, **TOL)


def test_moe_on_cuda() -> None:
    logits, x = rand(30, 16, seed=1), rand(30, 12, seed=2)
    up, down = rand(16, 20, 12, seed=3), rand(16, 12, 10, seed=4)
    bias = rand(16, seed=5)
    cpu = moe_route(logits, 4, "sigmoid", True, bias, 2.5, 4, 2)
    gpu = moe_route(logits.to(CUDA), 4, "sigmoid", True, bias.to(CUDA), 2.5, 4, 2)
    assert torch.equal(gpu.experts.cpu(), cpu.experts)
    torch.testing.assert_close(gpu.weights.cpu(), cpu.weights, **TOL)
    out = moe_experts(x.to(CUDA), gpu, up.to(CUDA), down.to(CUDA), "silu")
    torch.testing.assert_close(out.cpu(), moe_experts(x, cpu, up, down, "silu"), **TOL)
