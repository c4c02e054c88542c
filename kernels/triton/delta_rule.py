"""Twins of `reference.delta_rule`: the gated delta rule over a segment (prefill) and one decode step.

Both run one program per (sequence, value head, block of value dims) holding its [Dk, block] slice
of the state in registers: the state's value columns are independent (a column's update uses only
k, beta and that column), so value blocks run in parallel.

The prefill is the reference's chunked WY form: per chunk of Q <= 32 tokens, the unit lower-triangular
system (I + A) is inverted by forward substitution (Q row steps on a [Q, Q] tile), and the writes,
outputs and the next state are `tl.dot`s; only the chunks of one sequence are sequential. The
decode step is the token-recurrent form (FLA's fused_recurrent): decay, delta-rule write, read-out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..reference import delta_rule as _ref
from ..reference.delta_rule import DeltaResult
from ..reference.state_rows import check_state_indices
from ..varlen import Varlen
from .jit_math import dot_precision, next_pow2


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
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, init_ptr, out_ptr, final_ptr, idx_ptr,
    length, k_dim, v_dim, heads_per_k, scale,
    sq_b, sq_l, sq_h, sk_b, sk_l, sk_h, sv_b, sv_l, sv_h, sg_b, sg_l, sg_h, sbt_b, sbt_l, sbt_h,
    si_b, si_h, si_k, si_v, so_b, so_l, so_h, sf_b, sf_h, sf_k, sf_v,
    L2NORM: tl.constexpr, HAS_INIT: tl.constexpr, HAS_IDX: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    # The initial and final state rows of batch row b: its pool slot when given indices.
    row = b
    if HAS_IDX:
        row = tl.load(idx_ptr + b).to(tl.int64)
    hv = tl.program_id(1)
    hk = hv // heads_per_k
    ks = tl.arange(0, BLOCK_K)
    k_mask = ks < k_dim
    vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_mask = vs < v_dim
    state_mask = k_mask[:, None] & v_mask[None, :]
    if HAS_INIT:
        state = tl.load(init_ptr + row * si_b + hv * si_h + ks[:, None] * si_k + vs[None, :] * si_v, mask=state_mask,
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
    tl.store(final_ptr + row * sf_b + hv * sf_h + ks[:, None] * sf_k + vs[None, :] * sf_v,
             state.to(final_ptr.dtype.element_ty), mask=state_mask)  # fmt: skip


@triton.jit
def _l2norm_rows(x, L2NORM: tl.constexpr):
    if L2NORM:
        x = x * tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]
    return x


@triton.jit
def _chunk_delta_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, init_ptr, out_ptr, final_ptr,
    length, k_dim, v_dim, heads_per_k, scale,
    sq_b, sq_l, sq_h, sk_b, sk_l, sk_h, sv_b, sv_l, sv_h, sg_b, sg_l, sg_h, sbt_b, sbt_l, sbt_h,
    si_b, si_h, si_k, si_v, so_b, so_l, so_h, sf_b, sf_h, sf_k, sf_v,
    L2NORM: tl.constexpr, HAS_INIT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // heads_per_k
    ks = tl.arange(0, BLOCK_K)
    k_mask = ks < k_dim
    vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_mask = vs < v_dim
    qs = tl.arange(0, BLOCK_Q)
    lower = qs[:, None] >= qs[None, :]
    strictly_lower = qs[:, None] > qs[None, :]
    state_mask = k_mask[:, None] & v_mask[None, :]
    if HAS_INIT:
        state = tl.load(init_ptr + b * si_b + hv * si_h + ks[:, None] * si_k + vs[None, :] * si_v, mask=state_mask,
                        other=0.0).to(tl.float32)  # fmt: skip
    else:
        state = tl.zeros((BLOCK_K, BLOCK_V), dtype=tl.float32)
    for start in range(0, length, BLOCK_Q):
        ts = start + qs
        t_mask = ts < length
        qk_mask = t_mask[:, None] & k_mask[None, :]
        q = tl.load(q_ptr + b * sq_b + ts[:, None] * sq_l + hk * sq_h + ks[None, :], mask=qk_mask, other=0.0)
        k = tl.load(k_ptr + b * sk_b + ts[:, None] * sk_l + hk * sk_h + ks[None, :], mask=qk_mask, other=0.0)
        q = _l2norm_rows(q.to(tl.float32), L2NORM) * scale
        k = _l2norm_rows(k.to(tl.float32), L2NORM)
        v = tl.load(v_ptr + b * sv_b + ts[:, None] * sv_l + hv * sv_h + vs[None, :],
                    mask=t_mask[:, None] & v_mask[None, :], other=0.0).to(tl.float32)  # fmt: skip
        # Tokens past the end: no decay (g = 0) and no write (beta = 0).
        g = tl.load(g_ptr + b * sg_b + ts * sg_l + hv * sg_h, mask=t_mask, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + b * sbt_b + ts * sbt_l + hv * sbt_h, mask=t_mask, other=0.0).to(tl.float32)
        gamma = tl.cumsum(g, axis=0)
        decay = tl.exp(tl.where(lower, gamma[:, None] - gamma[None, :], float("-inf")))  # Gamma[t, s], s <= t
        kk = tl.dot(k, tl.trans(k), input_precision=PRECISION)
        system = tl.where(strictly_lower, beta[:, None] * kk * decay, 0.0)  # A; the system is I + A
        # T = (I + A)^-1 by forward substitution: row i is e_i - sum_{j<i} A[i, j] T[j].
        inverse = tl.zeros((BLOCK_Q, BLOCK_Q), dtype=tl.float32)
        for i in range(BLOCK_Q):
            a_row = tl.sum(tl.where(qs[:, None] == i, system, 0.0), axis=0)  # A[i, :]
            row = tl.where(qs == i, 1.0, 0.0) - tl.sum(a_row[:, None] * inverse, axis=0)
            inverse = tl.where(qs[:, None] == i, row[None, :], inverse)
        w = tl.dot(inverse, v * beta[:, None], input_precision=PRECISION)  # [Q, BV]
        k_cum = tl.dot(inverse, k * (tl.exp(gamma) * beta)[:, None], input_precision=PRECISION)  # [Q, BK]
        u = w - tl.dot(k_cum, state, input_precision=PRECISION)  # the writes, given the chunk's start state
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * decay
        out = tl.dot(scores, u, input_precision=PRECISION)
        out += tl.dot(q * tl.exp(gamma)[:, None], state, input_precision=PRECISION)
        tl.store(out_ptr + b * so_b + ts[:, None] * so_l + hv * so_h + vs[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=t_mask[:, None] & v_mask[None, :])  # fmt: skip
        total = tl.sum(g, axis=0)
        k_end = k * tl.exp(total - gamma)[:, None]
        state = state * tl.exp(total) + tl.dot(tl.trans(k_end), u, input_precision=PRECISION)
    tl.store(final_ptr + b * sf_b + hv * sf_h + ks[:, None] * sf_k + vs[None, :] * sf_v,
             state.to(final_ptr.dtype.element_ty), mask=state_mask)  # fmt: skip


def _unit_last(**tensors: Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"the Triton delta rule needs {name} with a unit stride on its last dim, got {t.stride()}")


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
    """Twin of `reference.delta_rule.chunk_gated_delta_rule` (chunks of <= 32 tokens: only rounding differs)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    _ref._check_layout(q, k, v, g, beta, token_dims=2)
    batch, length, k_heads, k_dim = q.shape
    v_heads, v_dim = v.shape[2], v.shape[3]
    state_shape = (batch, v_heads, k_dim, v_dim)
    if initial_state is not None and tuple(initial_state.shape) != state_shape:
        raise ValueError(f"initial_state must be {list(state_shape)}, got {tuple(initial_state.shape)}")
    state_dtype = torch.float32 if initial_state is None else initial_state.dtype
    out = torch.empty(batch, length, v_heads, v_dim, dtype=q.dtype, device=q.device)
    final = torch.empty(state_shape, dtype=state_dtype, device=q.device)
    if batch == 0 or v_heads == 0:
        return DeltaResult(out, final)
    _unit_last(q=q, k=k, v=v)
    init = final if initial_state is None else initial_state
    scale = k_dim**-0.5 if scale is None else scale
    # Chunks of 32 and state blocks of [Dk, 32] for Dk > 64 keep the kernel within registers (with
    # Dk = 128, 64-token chunks or 64-wide blocks spill; ptxas then takes minutes).
    block_v = min(32 if k_dim > 64 else 64, next_pow2(v_dim, 16))
    _chunk_delta_kernel[(batch, v_heads, triton.cdiv(v_dim, block_v))](
        q, k, v, g, beta, init, out, final,
        length, k_dim, v_dim, v_heads // k_heads, scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), *g.stride(), *beta.stride(),
        *init.stride(), out.stride(0), out.stride(1), out.stride(2), *final.stride(),
        L2NORM=use_qk_l2norm, HAS_INIT=initial_state is not None, PRECISION=dot_precision(q, k, v),
        BLOCK_Q=min(32, next_pow2(chunk_size, 16)), BLOCK_K=next_pow2(k_dim, 16), BLOCK_V=block_v,
    )  # fmt: skip
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
    state_batch_indices: Tensor | None = None,
) -> Tensor:
    """Twin of `reference.delta_rule.recurrent_gated_delta_rule_update`: updates `state` in place,
    with `state_batch_indices` the pool rows it names."""
    rows = state
    if state_batch_indices is not None:
        rows = check_state_indices(state, q.shape[0], state_batch_indices)
    _ref.check_update_state(q, k, v, g, beta, rows)
    batch, _, k_dim = q.shape
    v_heads, v_dim = v.shape[1], v.shape[2]
    out = torch.empty(batch, v_heads, v_dim, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    _unit_last(q=q, k=k, v=v)
    # In place: the state is both the initial and the final state of a one-token segment, and every
    # per-token tensor gets a length dim of 1.
    q, k, v, g, beta, step_out = (t.unsqueeze(1) for t in (q, k, v, g, beta, out))
    block_v = min(32, next_pow2(v_dim))
    _delta_kernel[(batch, v_heads, triton.cdiv(v_dim, block_v))](
        q, k, v, g, beta, state, step_out, state, q if state_batch_indices is None else state_batch_indices,
        1, k_dim, v_dim, v_heads // q.shape[2], k_dim**-0.5 if scale is None else scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), *g.stride(), *beta.stride(),
        *state.stride(), step_out.stride(0), step_out.stride(1), step_out.stride(2), *state.stride(),
        L2NORM=use_qk_l2norm, HAS_INIT=True, HAS_IDX=state_batch_indices is not None, BLOCK_K=next_pow2(k_dim),
        BLOCK_V=block_v,
    )  # fmt: skip
    return out


@triton.jit
def _chunk_delta_varlen_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, pool_ptr, out_ptr,
    cu_ptr, slots_ptr, prefix_ptr, cu_cap_ptr, cap_off_ptr, cap_slot_ptr,
    k_dim, v_dim, heads_per_k, scale,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sbt_t, sbt_h, sp_s, sp_h, sp_k, sp_v, so_t, so_h,
    L2NORM: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // heads_per_k
    bos = tl.load(cu_ptr + seq).to(tl.int32)
    length = tl.load(cu_ptr + seq + 1).to(tl.int32) - bos
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    # Rows of the initial state read from the slot: all with a cached prefix, none (zeros) without.
    init_rows = tl.where(tl.load(prefix_ptr + seq) > 0, k_dim, 0)
    cap = tl.load(cu_cap_ptr + seq).to(tl.int32)
    cap_end = tl.load(cu_cap_ptr + seq + 1).to(tl.int32)
    ks = tl.arange(0, BLOCK_K)
    k_mask = ks < k_dim
    vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_mask = vs < v_dim
    qs = tl.arange(0, BLOCK_Q)
    lower = qs[:, None] >= qs[None, :]
    strictly_lower = qs[:, None] > qs[None, :]
    state_mask = k_mask[:, None] & v_mask[None, :]
    state_off = hv * sp_h + ks[:, None] * sp_k + vs[None, :] * sp_v
    state = tl.load(pool_ptr + slot * sp_s + state_off, mask=(ks < init_rows)[:, None] & v_mask[None, :], other=0.0).to(
        tl.float32
    )
    start = length * 0
    while start < length:
        # Chunks end at BLOCK_Q tokens or at the next capture offset (see `ssd_scan_varlen`).
        cut = tl.where(cap < cap_end, tl.load(cap_off_ptr + cap).to(tl.int32), length)
        end = tl.minimum(start + BLOCK_Q, cut)
        ts = start + qs
        t_mask = ts < end
        rows = (bos + ts).to(tl.int64)
        qk_mask = t_mask[:, None] & k_mask[None, :]
        q = tl.load(q_ptr + rows[:, None] * sq_t + hk * sq_h + ks[None, :], mask=qk_mask, other=0.0)
        k = tl.load(k_ptr + rows[:, None] * sk_t + hk * sk_h + ks[None, :], mask=qk_mask, other=0.0)
        q = _l2norm_rows(q.to(tl.float32), L2NORM) * scale
        k = _l2norm_rows(k.to(tl.float32), L2NORM)
        v = tl.load(v_ptr + rows[:, None] * sv_t + hv * sv_h + vs[None, :],
                    mask=t_mask[:, None] & v_mask[None, :], other=0.0).to(tl.float32)  # fmt: skip
        g = tl.load(g_ptr + rows * sg_t + hv * sg_h, mask=t_mask, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + rows * sbt_t + hv * sbt_h, mask=t_mask, other=0.0).to(tl.float32)
        gamma = tl.cumsum(g, axis=0)
        decay = tl.exp(tl.where(lower, gamma[:, None] - gamma[None, :], float("-inf")))
        kk = tl.dot(k, tl.trans(k), input_precision=PRECISION)
        system = tl.where(strictly_lower, beta[:, None] * kk * decay, 0.0)
        inverse = tl.zeros((BLOCK_Q, BLOCK_Q), dtype=tl.float32)
        for i in range(BLOCK_Q):
            a_row = tl.sum(tl.where(qs[:, None] == i, system, 0.0), axis=0)
            row = tl.where(qs == i, 1.0, 0.0) - tl.sum(a_row[:, None] * inverse, axis=0)
            inverse = tl.where(qs[:, None] == i, row[None, :], inverse)
        w = tl.dot(inverse, v * beta[:, None], input_precision=PRECISION)
        k_cum = tl.dot(inverse, k * (tl.exp(gamma) * beta)[:, None], input_precision=PRECISION)
        u = w - tl.dot(k_cum, state, input_precision=PRECISION)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * decay
        out = tl.dot(scores, u, input_precision=PRECISION)
        out += tl.dot(q * tl.exp(gamma)[:, None], state, input_precision=PRECISION)
        tl.store(out_ptr + rows[:, None] * so_t + hv * so_h + vs[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=t_mask[:, None] & v_mask[None, :])  # fmt: skip
        total = tl.sum(g, axis=0)
        k_end = k * tl.exp(total - gamma)[:, None]
        state = state * tl.exp(total) + tl.dot(tl.trans(k_end), u, input_precision=PRECISION)
        start = end
        nxt = tl.where(cap < cap_end, tl.load(cap_off_ptr + cap).to(tl.int32), -1)
        while nxt == end:
            target = tl.load(cap_slot_ptr + cap).to(tl.int64)
            tl.store(pool_ptr + target * sp_s + state_off, state.to(pool_ptr.dtype.element_ty), mask=state_mask)
            cap += 1
            nxt = tl.where(cap < cap_end, tl.load(cap_off_ptr + cap).to(tl.int32), -1)
    tl.store(pool_ptr + slot * sp_s + state_off, state.to(pool_ptr.dtype.element_ty), mask=state_mask)


def chunk_gated_delta_rule_varlen(
    q: Tensor,
    k: Tensor,
    val: Tensor,
    g: Tensor,
    beta: Tensor,
    chunk_size: int,
    state_pool: Tensor,
    state_slots: Tensor,
    v: Varlen,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
) -> Tensor:
    """Twin of `segmented`'s gated delta rule over a packed batch: one launch for every sequence."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    _ref._check_layout(q[None], k[None], val[None], g[None], beta[None], token_dims=2)
    if q.shape[0] != v.num_tokens:
        raise ValueError(f"q must be [T={v.num_tokens}, Hk, Dk], got {tuple(q.shape)}")
    _, k_heads, k_dim = q.shape
    v_heads, v_dim = val.shape[1], val.shape[2]
    if state_pool.dim() != 4 or tuple(state_pool.shape[1:]) != (v_heads, k_dim, v_dim):
        raise ValueError(f"state_pool must be [slots, {v_heads}, {k_dim}, {v_dim}], got {tuple(state_pool.shape)}")
    out = torch.empty(q.shape[0], v_heads, v_dim, dtype=q.dtype, device=q.device)
    if v.num_seqs == 0 or v_heads == 0:
        return out
    _unit_last(q=q, k=k, v=val)
    scale = k_dim**-0.5 if scale is None else scale
    block_v = min(32 if k_dim > 64 else 64, next_pow2(v_dim, 16))
    _chunk_delta_varlen_kernel[(v.num_seqs, v_heads, triton.cdiv(v_dim, block_v))](
        q, k, val, g, beta, state_pool, out,
        v.cu_seqlens, state_slots, v.prefix, v.cu_captures, v.capture_offsets, v.capture_slots,
        k_dim, v_dim, v_heads // k_heads, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), val.stride(0), val.stride(1), *g.stride(), *beta.stride(),
        *state_pool.stride(), out.stride(0), out.stride(1),
        L2NORM=use_qk_l2norm, PRECISION=dot_precision(q, k, val),
        BLOCK_Q=min(32, next_pow2(chunk_size, 16)), BLOCK_K=next_pow2(k_dim, 16), BLOCK_V=block_v,
    )  # fmt: skip
    return out
