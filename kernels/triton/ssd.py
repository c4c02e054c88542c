"""Twins of `reference.ssd`: the Mamba2 chunked scan (prefill) and the selective-state update (decode).

The scan runs one program per (sequence, head, block of head dims). It walks the sequence chunk
by chunk, keeping its [P, N] block of the state in registers: inside a chunk the recurrence is
the masked, decay-weighted C·B product (state space duality, two tl.dot), and the state is
carried to the next chunk by one more tl.dot. Heads, sequences and head-dim blocks run in
parallel; only the chunks of one sequence are sequential. Everything is float32, as the reference.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..reference import ssd as _ref
from ..reference.ssd import ScanResult
from ..reference.state_rows import check_state_indices
from ..varlen import Varlen
from .jit_math import dot_precision, next_pow2, softplus


@triton.jit
def _dt(raw, bias, low, high, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr):
    dt = raw + bias
    if SOFTPLUS:
        dt = softplus(dt)
    if HAS_LIMIT:
        dt = tl.minimum(tl.maximum(dt, low), high)
    return dt


@triton.jit
def _ssd_scan_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, dt_bias_ptr, init_ptr, y_ptr, final_ptr,
    length, head_dim, state_size, heads_per_group, dt_low, dt_high,
    sx_b, sx_l, sx_h, sx_p, sdt_b, sdt_l, sdt_h, sb_b, sb_l, sb_g, sb_n, sc_b, sc_l, sc_g, sc_n,
    si_b, si_h, si_p, si_n, sy_b, sy_l, sy_h, sy_p, sf_b, sf_h, sf_p, sf_n,
    HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr,
    HAS_INIT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = h // heads_per_group
    ps = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_mask = ps < head_dim
    ns = tl.arange(0, BLOCK_N)
    n_mask = ns < state_size
    qs = tl.arange(0, BLOCK_Q)
    causal = qs[:, None] >= qs[None, :]
    a = tl.load(a_ptr + h).to(tl.float32)
    dt_bias = 0.0
    if HAS_DT_BIAS:
        dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    skip = 0.0
    if HAS_D:
        skip = tl.load(d_ptr + h).to(tl.float32)
    state_mask = p_mask[:, None] & n_mask[None, :]
    if HAS_INIT:
        state = tl.load(init_ptr + b * si_b + h * si_h + ps[:, None] * si_p + ns[None, :] * si_n, mask=state_mask,
                        other=0.0).to(tl.float32)  # fmt: skip
    else:
        state = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for start in range(0, length, BLOCK_Q):
        ts = start + qs
        t_mask = ts < length
        raw = tl.load(dt_ptr + b * sdt_b + ts * sdt_l + h * sdt_h, mask=t_mask, other=0.0).to(tl.float32)
        # Tokens past the end get dt = 0: no decay and no input.
        dt = tl.where(t_mask, _dt(raw, dt_bias, dt_low, dt_high, SOFTPLUS, HAS_LIMIT), 0.0)
        log_decay = tl.cumsum(dt * a, axis=0)  # [Q]: sum of dt*A over the chunk up to each token
        total = tl.sum(dt * a, axis=0)
        x = tl.load(x_ptr + b * sx_b + ts[:, None] * sx_l + h * sx_h + ps[None, :] * sx_p,
                    mask=t_mask[:, None] & p_mask[None, :], other=0.0).to(tl.float32)  # fmt: skip
        bm = tl.load(b_ptr + b * sb_b + ts[:, None] * sb_l + g * sb_g + ns[None, :] * sb_n,
                     mask=t_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)  # fmt: skip
        cm = tl.load(c_ptr + b * sc_b + ts[:, None] * sc_l + g * sc_g + ns[None, :] * sc_n,
                     mask=t_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)  # fmt: skip
        # Within the chunk: y_l = sum_{s<=l} (C_l·B_s) exp(cum_l - cum_s) dt_s x_s.
        cb = tl.dot(cm, tl.trans(bm), input_precision=PRECISION)  # [Q(l), Q(s)]
        decay = tl.exp(tl.where(causal, log_decay[:, None] - log_decay[None, :], float("-inf")))
        y = tl.dot(cb * decay * dt[None, :], x, input_precision=PRECISION)  # [Q, P]
        # From the state entering the chunk: exp(cum_l) C_l · h.
        y += tl.exp(log_decay)[:, None] * tl.dot(cm, tl.trans(state), input_precision=PRECISION)
        if HAS_D:
            y += skip * x
        tl.store(y_ptr + b * sy_b + ts[:, None] * sy_l + h * sy_h + ps[None, :] * sy_p,
                 y.to(y_ptr.dtype.element_ty), mask=t_mask[:, None] & p_mask[None, :])  # fmt: skip
        # The state after the chunk: decayed, plus each token's input decayed to the chunk's end.
        to_end = tl.exp(total - log_decay) * dt  # [Q]
        state = state * tl.exp(total) + tl.dot(tl.trans(x * to_end[:, None]), bm, input_precision=PRECISION)
    tl.store(final_ptr + b * sf_b + h * sf_h + ps[:, None] * sf_p + ns[None, :] * sf_n,
             state.to(final_ptr.dtype.element_ty), mask=state_mask)  # fmt: skip


@triton.jit
def _state_update_kernel(
    state_ptr, idx_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, dt_bias_ptr, y_ptr,
    head_dim, state_size, heads_per_group, dt_low, dt_high,
    ss_b, ss_h, ss_p, ss_n, sx_b, sx_h, sx_p, sdt_b, sdt_h, sb_b, sb_g, sb_n, sc_b, sc_g, sc_n, sy_b, sy_h,
    HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr,
    HAS_IDX: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    # The state row of batch row b: its pool slot when given indices (updated in place there).
    row = b
    if HAS_IDX:
        row = tl.load(idx_ptr + b).to(tl.int64)
    h = tl.program_id(1)
    g = h // heads_per_group
    ps = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_mask = ps < head_dim
    ns = tl.arange(0, BLOCK_N)
    n_mask = ns < state_size
    state_mask = p_mask[:, None] & n_mask[None, :]
    state_ptrs = state_ptr + row * ss_b + h * ss_h + ps[:, None] * ss_p + ns[None, :] * ss_n
    state = tl.load(state_ptrs, mask=state_mask, other=0.0).to(tl.float32)
    dt_bias = 0.0
    if HAS_DT_BIAS:
        dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    dt = _dt(tl.load(dt_ptr + b * sdt_b + h * sdt_h).to(tl.float32), dt_bias, dt_low, dt_high, SOFTPLUS, HAS_LIMIT)
    a = tl.load(a_ptr + h).to(tl.float32)
    x = tl.load(x_ptr + b * sx_b + h * sx_h + ps * sx_p, mask=p_mask, other=0.0).to(tl.float32)
    bv = tl.load(b_ptr + b * sb_b + g * sb_g + ns * sb_n, mask=n_mask, other=0.0).to(tl.float32)
    cv = tl.load(c_ptr + b * sc_b + g * sc_g + ns * sc_n, mask=n_mask, other=0.0).to(tl.float32)
    state = state * tl.exp(dt * a) + (x * dt)[:, None] * bv[None, :]
    tl.store(state_ptrs, state.to(state_ptr.dtype.element_ty), mask=state_mask)
    y = tl.sum(state * cv[None, :], axis=1)
    if HAS_D:
        y += tl.load(d_ptr + h).to(tl.float32) * x
    tl.store(y_ptr + b * sy_b + h * sy_h + ps, y.to(y_ptr.dtype.element_ty), mask=p_mask)


def _limit(dt_limit: tuple[float, float]) -> tuple[bool, float, float]:
    _ref.check_dt_limit(dt_limit)
    low, high = dt_limit
    has = (low, high) != (0.0, math.inf)
    # Kernel scalars are float32: an infinite bound is the largest float32.
    return has, max(low, -3.0e38), min(high, 3.0e38)


def ssd_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    initial_state: Tensor | None = None,
) -> ScanResult:
    """Twin of `reference.ssd.ssd_scan` (chunks of at most 64 tokens: chunking changes only rounding)."""
    _ref.check_scan_args(x, dt, A, B, C, chunk_size, D, dt_bias, initial_state)
    batch, length, heads, head_dim = x.shape
    rep = heads // B.shape[2]
    state_size = B.shape[3]
    state_shape = (batch, heads, head_dim, state_size)
    has_limit, low, high = _limit(dt_limit)
    state_dtype = torch.float32 if initial_state is None else initial_state.dtype
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    final = torch.empty(state_shape, dtype=state_dtype, device=x.device)
    if batch == 0 or heads == 0 or head_dim == 0:
        return ScanResult(y, final)
    init = final if initial_state is None else initial_state
    block_p = min(64, next_pow2(head_dim, 16))
    # tl.dot needs every dimension >= 16 on the GPU.
    block_q = min(64, next_pow2(chunk_size, 16))
    grid = (batch, heads, triton.cdiv(head_dim, block_p))
    _ssd_scan_kernel[grid](
        x, dt, A, B, C, x if D is None else D, x if dt_bias is None else dt_bias, init, y, final,
        length, head_dim, state_size, rep, low, high,
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *init.stride(), *y.stride(), *final.stride(),
        HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus, HAS_LIMIT=has_limit,
        HAS_INIT=initial_state is not None, PRECISION=dot_precision(x, B, C),
        BLOCK_Q=block_q, BLOCK_P=block_p, BLOCK_N=next_pow2(state_size, 16),
    )  # fmt: skip
    return ScanResult(y, final)


def selective_state_update(
    state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    state_batch_indices: Tensor | None = None,
) -> Tensor:
    """Twin of `reference.ssd.selective_state_update`: updates `state` (any strides) in place, with
    `state_batch_indices` the pool rows it names."""
    rows = state
    if state_batch_indices is not None:
        rows = check_state_indices(state, x.shape[0], state_batch_indices)
    rep = _ref.check_state_update_args(rows, x, dt, A, B, C, D, dt_bias)
    batch, heads, head_dim = x.shape
    state_size = B.shape[2]
    has_limit, low, high = _limit(dt_limit)
    y = torch.empty(batch, heads, head_dim, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    block_p = min(32, next_pow2(head_dim))
    grid = (batch, heads, triton.cdiv(head_dim, block_p))
    _state_update_kernel[grid](
        state, x if state_batch_indices is None else state_batch_indices,
        x, dt, A, B, C, x if D is None else D, x if dt_bias is None else dt_bias, y,
        head_dim, state_size, rep, low, high,
        *state.stride(), *x.stride(), *dt.stride(), *B.stride(), *C.stride(), y.stride(0), y.stride(1),
        HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus, HAS_LIMIT=has_limit,
        HAS_IDX=state_batch_indices is not None, BLOCK_P=block_p, BLOCK_N=next_pow2(state_size),
    )  # fmt: skip
    return y


@triton.jit
def _ssd_varlen_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, dt_bias_ptr, pool_ptr, y_ptr,
    cu_ptr, slots_ptr, prefix_ptr, cu_cap_ptr, cap_off_ptr, cap_slot_ptr,
    head_dim, state_size, heads_per_group, dt_low, dt_high,
    sx_t, sx_h, sx_p, sdt_t, sdt_h, sb_t, sb_g, sb_n, sc_t, sc_g, sc_n, sp_s, sp_h, sp_p, sp_n, sy_t, sy_h, sy_p,
    HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    h = tl.program_id(1)
    g = h // heads_per_group
    bos = tl.load(cu_ptr + seq).to(tl.int32)
    length = tl.load(cu_ptr + seq + 1).to(tl.int32) - bos
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    # Rows of the initial state read from the slot: all with a cached prefix, none (zeros) without.
    init_rows = tl.where(tl.load(prefix_ptr + seq) > 0, head_dim, 0)
    cap = tl.load(cu_cap_ptr + seq).to(tl.int32)
    cap_end = tl.load(cu_cap_ptr + seq + 1).to(tl.int32)
    ps = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_mask = ps < head_dim
    ns = tl.arange(0, BLOCK_N)
    n_mask = ns < state_size
    qs = tl.arange(0, BLOCK_Q)
    causal = qs[:, None] >= qs[None, :]
    a = tl.load(a_ptr + h).to(tl.float32)
    dt_bias = 0.0
    if HAS_DT_BIAS:
        dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    skip = 0.0
    if HAS_D:
        skip = tl.load(d_ptr + h).to(tl.float32)
    state_mask = p_mask[:, None] & n_mask[None, :]
    state_off = h * sp_h + ps[:, None] * sp_p + ns[None, :] * sp_n
    # From the slot when the sequence continues a cached prefix, else from zeros.
    state = tl.load(pool_ptr + slot * sp_s + state_off, mask=(ps < init_rows)[:, None] & n_mask[None, :], other=0.0).to(
        tl.float32
    )
    start = length * 0
    while start < length:
        # A chunk ends at BLOCK_Q tokens or at the next capture offset, whichever comes first, so
        # the state after a chunk is the state a capture asks for.
        cut = tl.where(cap < cap_end, tl.load(cap_off_ptr + cap).to(tl.int32), length)
        end = tl.minimum(start + BLOCK_Q, cut)
        ts = start + qs
        t_mask = ts < end
        rows = (bos + ts).to(tl.int64)
        raw = tl.load(dt_ptr + rows * sdt_t + h * sdt_h, mask=t_mask, other=0.0).to(tl.float32)
        dt = tl.where(t_mask, _dt(raw, dt_bias, dt_low, dt_high, SOFTPLUS, HAS_LIMIT), 0.0)
        log_decay = tl.cumsum(dt * a, axis=0)
        total = tl.sum(dt * a, axis=0)
        x = tl.load(x_ptr + rows[:, None] * sx_t + h * sx_h + ps[None, :] * sx_p,
                    mask=t_mask[:, None] & p_mask[None, :], other=0.0).to(tl.float32)  # fmt: skip
        bm = tl.load(b_ptr + rows[:, None] * sb_t + g * sb_g + ns[None, :] * sb_n,
                     mask=t_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)  # fmt: skip
        cm = tl.load(c_ptr + rows[:, None] * sc_t + g * sc_g + ns[None, :] * sc_n,
                     mask=t_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)  # fmt: skip
        cb = tl.dot(cm, tl.trans(bm), input_precision=PRECISION)
        decay = tl.exp(tl.where(causal, log_decay[:, None] - log_decay[None, :], float("-inf")))
        y = tl.dot(cb * decay * dt[None, :], x, input_precision=PRECISION)
        y += tl.exp(log_decay)[:, None] * tl.dot(cm, tl.trans(state), input_precision=PRECISION)
        if HAS_D:
            y += skip * x
        tl.store(y_ptr + rows[:, None] * sy_t + h * sy_h + ps[None, :] * sy_p, y.to(y_ptr.dtype.element_ty),
                 mask=t_mask[:, None] & p_mask[None, :])  # fmt: skip
        to_end = tl.exp(total - log_decay) * dt
        state = state * tl.exp(total) + tl.dot(tl.trans(x * to_end[:, None]), bm, input_precision=PRECISION)
        start = end
        # Every capture at this offset (several slots may ask for the same one).
        nxt = tl.where(cap < cap_end, tl.load(cap_off_ptr + cap).to(tl.int32), -1)
        while nxt == end:
            target = tl.load(cap_slot_ptr + cap).to(tl.int64)
            tl.store(pool_ptr + target * sp_s + state_off, state.to(pool_ptr.dtype.element_ty), mask=state_mask)
            cap += 1
            nxt = tl.where(cap < cap_end, tl.load(cap_off_ptr + cap).to(tl.int32), -1)
    tl.store(pool_ptr + slot * sp_s + state_off, state.to(pool_ptr.dtype.element_ty), mask=state_mask)


def ssd_scan_varlen(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None,
    dt_bias: Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    ssm_pool: Tensor,
    state_slots: Tensor,
    v: Varlen,
) -> Tensor:
    """Twin of `segmented`'s Mamba2 scan over a packed batch: one launch for every sequence; chunk
    boundaries fall on capture offsets (an offset inside a chunk splits it in two)."""
    rep = _ref.check_varlen_scan_args(x, dt, A, B, C, chunk_size, D, dt_bias, ssm_pool, state_slots, v)
    _, heads, head_dim = x.shape
    state_size = B.shape[2]
    has_limit, low, high = _limit(dt_limit)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if v.num_seqs == 0 or heads == 0 or head_dim == 0:
        return y
    block_p = min(64, next_pow2(head_dim, 16))
    block_q = min(64, next_pow2(chunk_size, 16))
    grid = (v.num_seqs, heads, triton.cdiv(head_dim, block_p))
    _ssd_varlen_kernel[grid](
        x, dt, A, B, C, x if D is None else D, x if dt_bias is None else dt_bias, ssm_pool, y,
        v.cu_seqlens, state_slots, v.prefix, v.cu_captures, v.capture_offsets, v.capture_slots,
        head_dim, state_size, rep, low, high,
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *ssm_pool.stride(), *y.stride(),
        HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus, HAS_LIMIT=has_limit,
        PRECISION=dot_precision(x, B, C), BLOCK_Q=block_q, BLOCK_P=block_p, BLOCK_N=next_pow2(state_size, 16),
    )  # fmt: skip
    return y
