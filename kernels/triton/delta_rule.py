"""Twins of `reference.delta_rule`: the gated delta rule over a segment (prefill) and one decode step.

Both are the token-recurrent form (FLA's fused_recurrent): one program per (sequence, value head,
block of value dims) keeps its [Dk, block] slice of the state in registers and applies, per token,
decay, the delta-rule write and the read-out. The state's value columns are independent (each
column's update uses only k, beta and that column), so value blocks run in parallel. The chunked
WY form of the reference is not built here: for long prefills it does more of the work in
matmuls, but needs a per-chunk triangular solve; see the README's kernel table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..reference import delta_rule as _ref
from ..reference.delta_rule import DeltaResult
from .jit_math import next_pow2


@triton.jit
def _delta_step(state, q_ptrs, k_ptrs, v_ptrs, g_ptr, beta_ptr, k_mask, v_mask, scale,
                L2NORM: tl.constexpr):  # fmt: skip
    """One token on the [Dk, BV] state: returns (new state, output [BV])."""
    q = tl.load(q_ptrs, mask=k_mask, other=0.0).to(tl.float32)
    k = tl.load(k_ptrs, mask=k_mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptrs, mask=v_mask, other=0.0).to(tl.float32)
    if L2NORM:
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    q = q * scale
    state = state * tl.exp(tl.load(g_ptr).to(tl.float32))
    predicted = tl.sum(k[:, None] * state, axis=0)  # S'^T k: [BV]
    write = (v - predicted) * tl.load(beta_ptr).to(tl.float32)
    state = state + k[:, None] * write[None, :]
    return state, tl.sum(q[:, None] * state, axis=0)


@triton.jit
def _delta_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, init_ptr, out_ptr, final_ptr,
    length, k_dim, v_dim, heads_per_k, scale,
    sq_b, sq_l, sq_h, sk_b, sk_l, sk_h, sv_b, sv_l, sv_h, sg_b, sg_l, sg_h, sbt_b, sbt_l, sbt_h,
    si_b, si_h, si_k, si_v, so_b, so_l, so_h, sf_b, sf_h, sf_k, sf_v,
    L2NORM: tl.constexpr, HAS_INIT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // heads_per_k
    ks = tl.arange(0, BLOCK_K)
    k_mask = ks < k_dim
    vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_mask = vs < v_dim
    state_mask = k_mask[:, None] & v_mask[None, :]
    if HAS_INIT:
        state = tl.load(init_ptr + b * si_b + hv * si_h + ks[:, None] * si_k + vs[None, :] * si_v, mask=state_mask,
                        other=0.0).to(tl.float32)  # fmt: skip
    else:
        state = tl.zeros((BLOCK_K, BLOCK_V), dtype=tl.float32)
    for t in range(length):
        state, o = _delta_step(
            state, q_ptr + b * sq_b + t * sq_l + hk * sq_h + ks, k_ptr + b * sk_b + t * sk_l + hk * sk_h + ks,
            v_ptr + b * sv_b + t * sv_l + hv * sv_h + vs, g_ptr + b * sg_b + t * sg_l + hv * sg_h,
            beta_ptr + b * sbt_b + t * sbt_l + hv * sbt_h, k_mask, v_mask, scale, L2NORM,
        )  # fmt: skip
        tl.store(out_ptr + b * so_b + t * so_l + hv * so_h + vs, o.to(out_ptr.dtype.element_ty), mask=v_mask)
    tl.store(final_ptr + b * sf_b + hv * sf_h + ks[:, None] * sf_k + vs[None, :] * sf_v,
             state.to(final_ptr.dtype.element_ty), mask=state_mask)  # fmt: skip


def _unit_last(**tensors: Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"the Triton delta rule needs {name} with a unit stride on its last dim, got {t.stride()}")


def _launch(q, k, v, g, beta, init, has_init: bool, out, final, length, scale, use_qk_l2norm, one_token: bool) -> None:
    batch, v_heads, k_dim, v_dim = final.shape
    k_heads = q.shape[-2]
    _unit_last(q=q, k=k, v=v)
    if one_token:
        # A decode step is a segment of one token: give every per-token tensor a zero length stride.
        q, k, v, out = (t.unsqueeze(1) for t in (q, k, v, out))
        g, beta = g.unsqueeze(1), beta.unsqueeze(1)
    block_v = min(32, next_pow2(v_dim))
    grid = (batch, v_heads, triton.cdiv(v_dim, block_v))
    _delta_kernel[grid](
        q, k, v, g, beta, init, out, final,
        length, k_dim, v_dim, v_heads // k_heads, scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), *g.stride(), *beta.stride(),
        *init.stride(), out.stride(0), out.stride(1), out.stride(2), *final.stride(),
        L2NORM=use_qk_l2norm, HAS_INIT=has_init,
        BLOCK_K=next_pow2(k_dim), BLOCK_V=block_v,
    )  # fmt: skip


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    chunk_size: int = 64,
    initial_state: Tensor | None = None,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
) -> DeltaResult:
    """Twin of `reference.delta_rule.chunk_gated_delta_rule` (token-recurrent: chunk_size is only checked)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    _ref._check_layout(q, k, v, g, beta, token_dims=2)
    batch, length, _, k_dim = q.shape
    v_heads, v_dim = v.shape[2], v.shape[3]
    state_shape = (batch, v_heads, k_dim, v_dim)
    if initial_state is not None and tuple(initial_state.shape) != state_shape:
        raise ValueError(f"initial_state must be {list(state_shape)}, got {tuple(initial_state.shape)}")
    state_dtype = torch.float32 if initial_state is None else initial_state.dtype
    out = torch.empty(batch, length, v_heads, v_dim, dtype=q.dtype, device=q.device)
    final = torch.empty(state_shape, dtype=state_dtype, device=q.device)
    if batch == 0 or v_heads == 0:
        return DeltaResult(out, final)
    init = final if initial_state is None else initial_state
    scale = k_dim**-0.5 if scale is None else scale
    _launch(
        q, k, v, g, beta, init, initial_state is not None, out, final, length, scale, use_qk_l2norm, one_token=False
    )
    return DeltaResult(out, final)


def recurrent_gated_delta_rule_update(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
) -> Tensor:
    """Twin of `reference.delta_rule.recurrent_gated_delta_rule_update`: updates `state` in place."""
    _ref._check_layout(q, k, v, g, beta, token_dims=1)
    batch, _, k_dim = q.shape
    v_heads, v_dim = v.shape[1], v.shape[2]
    if tuple(state.shape) != (batch, v_heads, k_dim, v_dim):
        raise ValueError(f"state must be [Bt={batch}, Hv={v_heads}, Dk={k_dim}, Dv={v_dim}], got {tuple(state.shape)}")
    out = torch.empty(batch, v_heads, v_dim, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    scale = k_dim**-0.5 if scale is None else scale
    # In place: the state is both the initial and the final state of a one-token segment.
    _launch(q, k, v, g, beta, state, True, out, state, 1, scale, use_qk_l2norm, one_token=True)
    return out
