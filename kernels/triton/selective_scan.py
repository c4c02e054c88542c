"""Twins of `reference.selective_scan`: the Mamba1 scan (prefill) and its decode step.

Mamba1's decay exp(dt * A) differs per (channel, state) element, so there is no chunked matmul
form: one program per (sequence, block of channels) keeps its [channels, N] block of the state
in registers and walks the tokens, as mamba_ssm's selective scan does per thread block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..reference import selective_scan as _ref
from ..reference.ssd import ScanResult
from ..reference.state_rows import check_state_indices
from ..varlen import Varlen
from .jit_math import next_pow2, silu, softplus


@triton.jit
def _step(state, u, dt_raw, z, a, bv, cv, dt_bias, skip,
          HAS_D: tl.constexpr, HAS_Z: tl.constexpr, SOFTPLUS: tl.constexpr):  # fmt: skip
    """One token: returns (new state [BD, N], y [BD])."""
    dt = dt_raw + dt_bias
    if SOFTPLUS:
        dt = softplus(dt)
    state = state * tl.exp(dt[:, None] * a) + (dt * u)[:, None] * bv[None, :]
    y = tl.sum(state * cv[None, :], axis=1)
    if HAS_D:
        y += skip * u
    if HAS_Z:
        y = y * silu(z)
    return state, y


@triton.jit
def _scan_kernel(
    u_ptr, delta_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, bias_ptr, init_ptr, y_ptr, final_ptr,
    length, channels, state_size,
    su_b, su_l, su_d, sdl_b, sdl_l, sdl_d, sa_d, sa_n, sb_b, sb_l, sb_n, sc_b, sc_l, sc_n, sz_b, sz_l, sz_d,
    si_b, si_d, si_n, sy_b, sy_l, sf_b, sf_d, sf_n,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_INIT: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = ds < channels
    ns = tl.arange(0, BLOCK_N)
    n_mask = ns < state_size
    state_mask = d_mask[:, None] & n_mask[None, :]
    a = tl.load(a_ptr + ds[:, None] * sa_d + ns[None, :] * sa_n, mask=state_mask, other=0.0).to(tl.float32)
    dt_bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_BIAS:
        dt_bias = tl.load(bias_ptr + ds, mask=d_mask, other=0.0).to(tl.float32)
    skip = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_D:
        skip = tl.load(d_ptr + ds, mask=d_mask, other=0.0).to(tl.float32)
    if HAS_INIT:
        state = tl.load(init_ptr + b * si_b + ds[:, None] * si_d + ns[None, :] * si_n, mask=state_mask,
                        other=0.0).to(tl.float32)  # fmt: skip
    else:
        state = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    for t in range(length):
        u = tl.load(u_ptr + b * su_b + t * su_l + ds * su_d, mask=d_mask, other=0.0).to(tl.float32)
        dt_raw = tl.load(delta_ptr + b * sdl_b + t * sdl_l + ds * sdl_d, mask=d_mask, other=0.0).to(tl.float32)
        bv = tl.load(b_ptr + b * sb_b + t * sb_l + ns * sb_n, mask=n_mask, other=0.0).to(tl.float32)
        cv = tl.load(c_ptr + b * sc_b + t * sc_l + ns * sc_n, mask=n_mask, other=0.0).to(tl.float32)
        z = u
        if HAS_Z:
            z = tl.load(z_ptr + b * sz_b + t * sz_l + ds * sz_d, mask=d_mask, other=0.0).to(tl.float32)
        state, y = _step(state, u, dt_raw, z, a, bv, cv, dt_bias, skip, HAS_D, HAS_Z, SOFTPLUS)
        tl.store(y_ptr + b * sy_b + t * sy_l + ds, y.to(y_ptr.dtype.element_ty), mask=d_mask)
    tl.store(final_ptr + b * sf_b + ds[:, None] * sf_d + ns[None, :] * sf_n,
             state.to(final_ptr.dtype.element_ty), mask=state_mask)  # fmt: skip


@triton.jit
def _update_kernel(
    state_ptr, idx_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, bias_ptr, y_ptr,
    channels, state_size,
    ss_b, ss_d, ss_n, sx_b, sx_d, sdt_b, sdt_d, sa_d, sa_n, sb_b, sb_n, sc_b, sc_n, sz_b, sz_d, sy_b,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_IDX: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    # The state row of batch row b: its pool slot when given indices (updated in place there).
    row = b
    if HAS_IDX:
        row = tl.load(idx_ptr + b).to(tl.int64)
    ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = ds < channels
    ns = tl.arange(0, BLOCK_N)
    n_mask = ns < state_size
    state_mask = d_mask[:, None] & n_mask[None, :]
    state_ptrs = state_ptr + row * ss_b + ds[:, None] * ss_d + ns[None, :] * ss_n
    state = tl.load(state_ptrs, mask=state_mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + ds[:, None] * sa_d + ns[None, :] * sa_n, mask=state_mask, other=0.0).to(tl.float32)
    dt_bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_BIAS:
        dt_bias = tl.load(bias_ptr + ds, mask=d_mask, other=0.0).to(tl.float32)
    skip = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_D:
        skip = tl.load(d_ptr + ds, mask=d_mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + b * sx_b + ds * sx_d, mask=d_mask, other=0.0).to(tl.float32)
    dt_raw = tl.load(dt_ptr + b * sdt_b + ds * sdt_d, mask=d_mask, other=0.0).to(tl.float32)
    bv = tl.load(b_ptr + b * sb_b + ns * sb_n, mask=n_mask, other=0.0).to(tl.float32)
    cv = tl.load(c_ptr + b * sc_b + ns * sc_n, mask=n_mask, other=0.0).to(tl.float32)
    z = x
    if HAS_Z:
        z = tl.load(z_ptr + b * sz_b + ds * sz_d, mask=d_mask, other=0.0).to(tl.float32)
    state, y = _step(state, x, dt_raw, z, a, bv, cv, dt_bias, skip, HAS_D, HAS_Z, SOFTPLUS)
    tl.store(state_ptrs, state.to(state_ptr.dtype.element_ty), mask=state_mask)
    tl.store(y_ptr + b * sy_b + ds, y.to(y_ptr.dtype.element_ty), mask=d_mask)


def _block_d(state_size: int) -> int:
    # About 2048 state elements per program: [BLOCK_D, N] stays in registers.
    return max(16, min(128, 2048 // next_pow2(state_size)))


def selective_scan(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = True,
    initial_state: Tensor | None = None,
) -> ScanResult:
    """Twin of `reference.selective_scan.selective_scan`."""
    if u.dim() != 3:
        raise ValueError(f"u must be [Bt, L, D], got {tuple(u.shape)}")
    batch, length, channels = u.shape
    if delta.shape != u.shape:
        raise ValueError(f"delta must have u's shape {tuple(u.shape)}, got {tuple(delta.shape)}")
    if z is not None and z.shape != u.shape:
        raise ValueError(f"z must have u's shape {tuple(u.shape)}, got {tuple(z.shape)}")
    state_size = _ref._check_params(channels, A, D, delta_bias, "delta_bias")
    for name, t in (("B", B), ("C", C)):
        if tuple(t.shape) != (batch, length, state_size):
            raise ValueError(f"{name} must be [Bt={batch}, L={length}, N={state_size}], got {tuple(t.shape)}")
    state_shape = (batch, channels, state_size)
    if initial_state is not None and tuple(initial_state.shape) != state_shape:
        raise ValueError(f"initial_state must be {list(state_shape)}, got {tuple(initial_state.shape)}")
    state_dtype = torch.float32 if initial_state is None else initial_state.dtype
    y = torch.empty(u.shape, dtype=u.dtype, device=u.device)
    final = torch.empty(state_shape, dtype=state_dtype, device=u.device)
    if batch == 0 or channels == 0:
        return ScanResult(y, final)
    init = final if initial_state is None else initial_state
    zz = u if z is None else z
    block_d = _block_d(state_size)
    _scan_kernel[(batch, triton.cdiv(channels, block_d))](
        u, delta, A, B, C, u if D is None else D, zz, u if delta_bias is None else delta_bias, init, y, final,
        length, channels, state_size,
        *u.stride(), *delta.stride(), *A.stride(), *B.stride(), *C.stride(), *zz.stride(),
        *init.stride(), y.stride(0), y.stride(1), *final.stride(),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, SOFTPLUS=delta_softplus,
        HAS_INIT=initial_state is not None, BLOCK_D=block_d, BLOCK_N=next_pow2(state_size),
    )  # fmt: skip
    return ScanResult(y, final)


def selective_state_update_mamba1(
    state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = True,
    state_batch_indices: Tensor | None = None,
) -> Tensor:
    """Twin of `reference.selective_scan.selective_state_update_mamba1`: updates `state` in place,
    with `state_batch_indices` the pool rows it names."""
    rows = state
    if state_batch_indices is not None:
        rows = check_state_indices(state, x.shape[0], state_batch_indices)
    _ref.check_update_args(rows, x, dt, A, B, C, D, z, dt_bias)
    batch, channels = x.shape
    state_size = A.shape[1]
    y = torch.empty(batch, channels, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    zz = x if z is None else z
    block_d = _block_d(state_size)
    _update_kernel[(batch, triton.cdiv(channels, block_d))](
        state, x if state_batch_indices is None else state_batch_indices,
        x, dt, A, B, C, x if D is None else D, zz, x if dt_bias is None else dt_bias, y,
        channels, state_size,
        *state.stride(), *x.stride(), *dt.stride(), *A.stride(), *B.stride(), *C.stride(), *zz.stride(), y.stride(0),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus,
        HAS_IDX=state_batch_indices is not None, BLOCK_D=block_d, BLOCK_N=next_pow2(state_size),
    )  # fmt: skip
    return y


@triton.jit
def _scan_varlen_kernel(
    u_ptr, delta_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, bias_ptr, pool_ptr, y_ptr,
    cu_ptr, slots_ptr, prefix_ptr, cu_cap_ptr, cap_off_ptr, cap_slot_ptr,
    channels, state_size,
    su_t, su_d, sdl_t, sdl_d, sa_d, sa_n, sb_t, sb_n, sc_t, sc_n, sz_t, sz_d, sp_s, sp_d, sp_n, sy_t,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    bos = tl.load(cu_ptr + seq).to(tl.int32)
    length = tl.load(cu_ptr + seq + 1).to(tl.int32) - bos
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    # Rows of the initial state read from the slot: all with a cached prefix, none (zeros) without.
    init_rows = tl.where(tl.load(prefix_ptr + seq) > 0, channels, 0)
    cap = tl.load(cu_cap_ptr + seq).to(tl.int32)
    cap_end = tl.load(cu_cap_ptr + seq + 1).to(tl.int32)
    ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = ds < channels
    ns = tl.arange(0, BLOCK_N)
    n_mask = ns < state_size
    state_mask = d_mask[:, None] & n_mask[None, :]
    state_off = ds[:, None] * sp_d + ns[None, :] * sp_n
    a = tl.load(a_ptr + ds[:, None] * sa_d + ns[None, :] * sa_n, mask=state_mask, other=0.0).to(tl.float32)
    dt_bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_BIAS:
        dt_bias = tl.load(bias_ptr + ds, mask=d_mask, other=0.0).to(tl.float32)
    skip = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_D:
        skip = tl.load(d_ptr + ds, mask=d_mask, other=0.0).to(tl.float32)
    state = tl.load(pool_ptr + slot * sp_s + state_off, mask=(ds < init_rows)[:, None] & n_mask[None, :], other=0.0).to(
        tl.float32
    )
    # The next capture offset (-1: none left); the scan is per token, so any offset costs one store.
    nxt = tl.where(cap < cap_end, tl.load(cap_off_ptr + cap).to(tl.int32), -1)
    for t in range(length):
        row = (bos + t).to(tl.int64)
        u = tl.load(u_ptr + row * su_t + ds * su_d, mask=d_mask, other=0.0).to(tl.float32)
        dt_raw = tl.load(delta_ptr + row * sdl_t + ds * sdl_d, mask=d_mask, other=0.0).to(tl.float32)
        bv = tl.load(b_ptr + row * sb_t + ns * sb_n, mask=n_mask, other=0.0).to(tl.float32)
        cv = tl.load(c_ptr + row * sc_t + ns * sc_n, mask=n_mask, other=0.0).to(tl.float32)
        z = u
        if HAS_Z:
            z = tl.load(z_ptr + row * sz_t + ds * sz_d, mask=d_mask, other=0.0).to(tl.float32)
        state, y = _step(state, u, dt_raw, z, a, bv, cv, dt_bias, skip, HAS_D, HAS_Z, SOFTPLUS)
        tl.store(y_ptr + row * sy_t + ds, y.to(y_ptr.dtype.element_ty), mask=d_mask)
        while nxt == t + 1:
            target = tl.load(cap_slot_ptr + cap).to(tl.int64)
            tl.store(pool_ptr + target * sp_s + state_off, state.to(pool_ptr.dtype.element_ty), mask=state_mask)
            cap += 1
            nxt = tl.where(cap < cap_end, tl.load(cap_off_ptr + cap).to(tl.int32), -1)
    tl.store(pool_ptr + slot * sp_s + state_off, state.to(pool_ptr.dtype.element_ty), mask=state_mask)


def selective_scan_varlen(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    delta_bias: Tensor | None,
    delta_softplus: bool,
    ssm_pool: Tensor,
    state_slots: Tensor,
    v: Varlen,
) -> Tensor:
    """Twin of `segmented`'s Mamba1 scan over a packed batch: one launch for every sequence."""
    if u.dim() != 2 or u.shape[0] != v.num_tokens:
        raise ValueError(f"u must be [T={v.num_tokens}, D], got {tuple(u.shape)}")
    total, channels = u.shape
    for name, t in (("delta", delta), ("z", z)):
        if t is not None and t.shape != u.shape:
            raise ValueError(f"{name} must have u's shape {tuple(u.shape)}, got {tuple(t.shape)}")
    state_size = _ref._check_params(channels, A, D, delta_bias, "delta_bias")
    for name, t in (("B", B), ("C", C)):
        if tuple(t.shape) != (total, state_size):
            raise ValueError(f"{name} must be [T={total}, N={state_size}], got {tuple(t.shape)}")
    if ssm_pool.dim() != 3 or tuple(ssm_pool.shape[1:]) != (channels, state_size):
        raise ValueError(f"ssm_pool must be [slots, {channels}, {state_size}], got {tuple(ssm_pool.shape)}")
    y = torch.empty(u.shape, dtype=u.dtype, device=u.device)
    if v.num_seqs == 0 or channels == 0:
        return y
    zz = u if z is None else z
    block_d = _block_d(state_size)
    _scan_varlen_kernel[(v.num_seqs, triton.cdiv(channels, block_d))](
        u, delta, A, B, C, u if D is None else D, zz, u if delta_bias is None else delta_bias, ssm_pool, y,
        v.cu_seqlens, state_slots, v.prefix, v.cu_captures, v.capture_offsets, v.capture_slots,
        channels, state_size,
        *u.stride(), *delta.stride(), *A.stride(), *B.stride(), *C.stride(), *zz.stride(), *ssm_pool.stride(),
        y.stride(0),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, SOFTPLUS=delta_softplus,
        BLOCK_D=block_d, BLOCK_N=next_pow2(state_size),
    )  # fmt: skip
    return y
