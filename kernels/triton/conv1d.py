"""Twins of `reference.conv1d`: the causal depthwise conv over a segment and its single decode step.

Both read x, the weights and the carried state through their strides: x is usually a time-major
view of the in-projection ([B, L, D] seen as [B, D, L]) and the state rows of the pool.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..reference import conv1d as _ref
from ..reference.conv1d import ConvResult
from ..reference.state_rows import check_state_indices
from ..varlen import Varlen
from .jit_math import next_pow2, silu


@triton.jit
def _conv_kernel(
    x_ptr, w_ptr, bias_ptr, init_ptr, out_ptr, final_ptr,
    channels, length,
    sx_b, sx_d, sx_l, sw_d, sw_k, si_b, si_d, si_k, so_b, so_d, so_l, sf_b, sf_d, sf_k,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, SILU: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = ds < channels
    ts = tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L)
    t_mask = ts < length
    w_ty = w_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_D, BLOCK_L), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + ds, mask=d_mask, other=0.0).to(tl.float32)[:, None]
    for k in tl.static_range(WIDTH):
        # Input position of tap k; negative positions are the carried state's last columns.
        src = ts - (WIDTH - 1) + k
        mask = d_mask[:, None] & t_mask[None, :]
        xv = tl.load(x_ptr + b * sx_b + ds[:, None] * sx_d + src[None, :] * sx_l, mask=mask & (src >= 0)[None, :],
                     other=0.0).to(w_ty).to(tl.float32)  # fmt: skip
        if HAS_INIT:
            xv += tl.load(init_ptr + b * si_b + ds[:, None] * si_d + (src + WIDTH - 1)[None, :] * si_k,
                          mask=mask & (src < 0)[None, :], other=0.0).to(w_ty).to(tl.float32)  # fmt: skip
        w = tl.load(w_ptr + ds * sw_d + k * sw_k, mask=d_mask, other=0.0).to(tl.float32)
        acc += w[:, None] * xv
    if SILU:
        acc = silu(acc)
    out_mask = d_mask[:, None] & t_mask[None, :]
    tl.store(out_ptr + b * so_b + ds[:, None] * so_d + ts[None, :] * so_l, acc.to(out_ptr.dtype.element_ty),
             mask=out_mask)  # fmt: skip
    if tl.program_id(2) == 0:
        # The last WIDTH-1 inputs of concat(initial state, x): the state that continues the sequence.
        js = tl.arange(0, BLOCK_K)
        tail_src = length - (WIDTH - 1) + js
        tail_mask = d_mask[:, None] & (js < WIDTH - 1)[None, :]
        tail = tl.load(x_ptr + b * sx_b + ds[:, None] * sx_d + tail_src[None, :] * sx_l, mask=tail_mask & (tail_src >= 0)[None, :],
                       other=0.0).to(w_ty)  # fmt: skip
        if HAS_INIT:
            tail += tl.load(init_ptr + b * si_b + ds[:, None] * si_d + (tail_src + WIDTH - 1)[None, :] * si_k,
                            mask=tail_mask & (tail_src < 0)[None, :], other=0.0).to(w_ty)  # fmt: skip
        tl.store(final_ptr + b * sf_b + ds[:, None] * sf_d + js[None, :] * sf_k,
                 tail.to(final_ptr.dtype.element_ty), mask=tail_mask)  # fmt: skip


@triton.jit
def _conv_update_kernel(
    x_ptr, state_ptr, idx_ptr, w_ptr, bias_ptr, out_ptr,
    channels, sx_b, sx_d, ss_b, ss_d, ss_k, sw_d, sw_k, so_b,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, HAS_IDX: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    # The state row of batch row b: its pool slot when given indices (updated in place there).
    row = b
    if HAS_IDX:
        row = tl.load(idx_ptr + b).to(tl.int64)
    state_ptr += row * ss_b
    ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = ds < channels
    ks = tl.arange(0, BLOCK_K)
    w_ty = w_ptr.dtype.element_ty
    # The window [state columns 0..K-2, x]: column K-1 comes from x, the others from the state.
    state_mask = d_mask[:, None] & (ks < WIDTH - 1)[None, :]
    window = tl.load(state_ptr + ds[:, None] * ss_d + ks[None, :] * ss_k, mask=state_mask,
                     other=0.0).to(w_ty)  # fmt: skip
    xv = tl.load(x_ptr + b * sx_b + ds * sx_d, mask=d_mask, other=0.0).to(w_ty)
    window = tl.where((ks == WIDTH - 1)[None, :], xv[:, None], window)
    w = tl.load(w_ptr + ds[:, None] * sw_d + ks[None, :] * sw_k, mask=d_mask[:, None] & (ks < WIDTH)[None, :],
                other=0.0).to(tl.float32)  # fmt: skip
    acc = tl.sum(window.to(tl.float32) * w, axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + ds, mask=d_mask, other=0.0).to(tl.float32)
    if SILU:
        acc = silu(acc)
    tl.store(out_ptr + b * so_b + ds, acc.to(out_ptr.dtype.element_ty), mask=d_mask)
    # Shift left by one: new column j is window column j + 1. Every program has loaded its whole
    # window above, and no two programs share a state row, so the in-place store is safe.
    shifted = tl.load(state_ptr + ds[:, None] * ss_d + (ks + 1)[None, :] * ss_k,
                      mask=d_mask[:, None] & (ks < WIDTH - 2)[None, :], other=0.0).to(w_ty)  # fmt: skip
    shifted = tl.where((ks == WIDTH - 2)[None, :], xv[:, None], shifted)
    tl.store(state_ptr + ds[:, None] * ss_d + ks[None, :] * ss_k,
             shifted.to(state_ptr.dtype.element_ty), mask=state_mask)  # fmt: skip


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    initial_state: Tensor | None,
    activation: str | None = "silu",
) -> ConvResult:
    """Twin of `reference.conv1d.causal_conv1d`; `out` is time-major when x is (as the reference's)."""
    width = _ref.check_args(x, weight, bias, initial_state, activation)
    batch, channels, length = x.shape
    state_dtype = x.dtype if initial_state is None else initial_state.dtype
    if x.stride(1) == 1:
        out = torch.empty(batch, length, channels, dtype=x.dtype, device=x.device).transpose(1, 2)
    else:
        out = torch.empty(batch, channels, length, dtype=x.dtype, device=x.device)
    final = torch.empty(batch, channels, width - 1, dtype=state_dtype, device=x.device)
    if batch == 0 or channels == 0:
        return ConvResult(out, final)
    init = x if initial_state is None else initial_state
    block_d, block_l = 64, 32
    grid = (batch, triton.cdiv(channels, block_d), max(1, triton.cdiv(length, block_l)))
    _conv_kernel[grid](
        x, weight, x if bias is None else bias, init, out, final,
        channels, length,
        *x.stride(), *weight.stride(), *init.stride(), *out.stride(), *final.stride(),
        WIDTH=width, HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None, SILU=activation == "silu",
        BLOCK_D=block_d, BLOCK_L=block_l, BLOCK_K=next_pow2(width - 1),
    )  # fmt: skip
    return ConvResult(out, final)


def causal_conv1d_update(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    activation: str | None = "silu",
    conv_state_indices: Tensor | None = None,
) -> Tensor:
    """Twin of `reference.conv1d.causal_conv1d_update`: updates conv_state (any strides) in place,
    with `conv_state_indices` the pool rows it names."""
    rows = conv_state
    if conv_state_indices is not None:
        rows = check_state_indices(conv_state, x.shape[0], conv_state_indices)
    width = _ref.check_update_args(x, rows, weight, bias, activation)
    batch, channels = x.shape
    out = torch.empty(batch, channels, dtype=x.dtype, device=x.device)
    if batch == 0 or channels == 0:
        return out
    block_d = 128
    _conv_update_kernel[(batch, triton.cdiv(channels, block_d))](
        x, conv_state, x if conv_state_indices is None else conv_state_indices, weight, x if bias is None else bias,
        out, channels, *x.stride(), *conv_state.stride(), *weight.stride(), out.stride(0),
        WIDTH=width, HAS_BIAS=bias is not None, SILU=activation == "silu", HAS_IDX=conv_state_indices is not None,
        BLOCK_D=block_d, BLOCK_K=next_pow2(width),
    )  # fmt: skip
    return out


@triton.jit
def _conv_varlen_kernel(
    x_ptr, w_ptr, bias_ptr, pool_ptr, out_ptr, cu_ptr, slots_ptr, prefix_ptr, cu_cap_ptr, cap_off_ptr, cap_slot_ptr,
    channels, sx_t, sx_d, sw_d, sw_k, sp_s, sp_d, sp_k, so_t,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    bos = tl.load(cu_ptr + seq).to(tl.int32)
    length = tl.load(cu_ptr + seq + 1).to(tl.int32) - bos
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    # A sequence with no cached prefix starts from zeros, whatever its slot holds: it reads no
    # state column (positions >= -init_cols come from the slot).
    init_cols = tl.where(tl.load(prefix_ptr + seq) > 0, WIDTH - 1, 0)
    ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = ds < channels
    ts = tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L)
    t_mask = ts < length
    w_ty = w_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_D, BLOCK_L), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + ds, mask=d_mask, other=0.0).to(tl.float32)[:, None]
    mask = d_mask[:, None] & t_mask[None, :]
    for k in tl.static_range(WIDTH):
        src = ts - (WIDTH - 1) + k
        xv = tl.load(x_ptr + (bos + src)[None, :].to(tl.int64) * sx_t + ds[:, None] * sx_d,
                     mask=mask & (src >= 0)[None, :], other=0.0).to(w_ty).to(tl.float32)  # fmt: skip
        xv += tl.load(pool_ptr + slot * sp_s + ds[:, None] * sp_d + (src + WIDTH - 1)[None, :] * sp_k,
                      mask=mask & ((src < 0) & (src >= -init_cols))[None, :], other=0.0).to(w_ty).to(tl.float32)  # fmt: skip
        w = tl.load(w_ptr + ds * sw_d + k * sw_k, mask=d_mask, other=0.0).to(tl.float32)
        acc += w[:, None] * xv
    if SILU:
        acc = silu(acc)
    tl.store(out_ptr + (bos + ts)[None, :].to(tl.int64) * so_t + ds[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=mask)  # fmt: skip
    if tl.program_id(2) == 0:
        # Only this program reads the slot's initial columns (BLOCK_L >= WIDTH - 1), so it may
        # overwrite them: captures first (they may still read them), the final state last.
        js = tl.arange(0, BLOCK_K)
        j_mask = d_mask[:, None] & (js < WIDTH - 1)[None, :]
        for c in range(tl.load(cu_cap_ptr + seq).to(tl.int32), tl.load(cu_cap_ptr + seq + 1).to(tl.int32)):
            end = tl.load(cap_off_ptr + c).to(tl.int32)
            target = tl.load(cap_slot_ptr + c).to(tl.int64)
            cap_src = end - (WIDTH - 1) + js
            cap_tail = tl.load(x_ptr + (bos + cap_src)[None, :].to(tl.int64) * sx_t + ds[:, None] * sx_d,
                           mask=j_mask & (cap_src >= 0)[None, :], other=0.0).to(w_ty)  # fmt: skip
            cap_tail += tl.load(pool_ptr + slot * sp_s + ds[:, None] * sp_d + (cap_src + WIDTH - 1)[None, :] * sp_k,
                            mask=j_mask & ((cap_src < 0) & (cap_src >= -init_cols))[None, :], other=0.0).to(w_ty)  # fmt: skip
            tl.store(pool_ptr + target * sp_s + ds[:, None] * sp_d + js[None, :] * sp_k,
                     cap_tail.to(pool_ptr.dtype.element_ty), mask=j_mask)  # fmt: skip
        tail_src = length - (WIDTH - 1) + js
        tail = tl.load(x_ptr + (bos + tail_src)[None, :].to(tl.int64) * sx_t + ds[:, None] * sx_d,
                       mask=j_mask & (tail_src >= 0)[None, :], other=0.0).to(w_ty)  # fmt: skip
        tail += tl.load(pool_ptr + slot * sp_s + ds[:, None] * sp_d + (tail_src + WIDTH - 1)[None, :] * sp_k,
                        mask=j_mask & ((tail_src < 0) & (tail_src >= -init_cols))[None, :], other=0.0).to(w_ty)  # fmt: skip
        tl.store(pool_ptr + slot * sp_s + ds[:, None] * sp_d + js[None, :] * sp_k,
                 tail.to(pool_ptr.dtype.element_ty), mask=j_mask)  # fmt: skip


def causal_conv1d_varlen(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_pool: Tensor,
    state_slots: Tensor,
    v: Varlen,
    activation: str | None = "silu",
) -> Tensor:
    """Twin of `segmented`'s causal conv over a packed batch: one launch for every sequence."""
    width = _ref.check_varlen_args(x, weight, bias, conv_pool, state_slots, v, activation)
    total, channels = x.shape
    out = torch.empty(total, channels, dtype=x.dtype, device=x.device)
    if v.num_seqs == 0 or channels == 0:
        return out
    block_d, block_l = 64, 32
    if width - 1 > block_l:
        # Only the first token block may read a sequence's slot, which it then overwrites in place.
        raise ValueError(f"the varlen conv takes kernel widths up to {block_l + 1}, got {width}")
    grid = (v.num_seqs, triton.cdiv(channels, block_d), max(1, triton.cdiv(v.max_len, block_l)))
    _conv_varlen_kernel[grid](
        x, weight, x if bias is None else bias, conv_pool, out,
        v.cu_seqlens, state_slots, v.prefix, v.cu_captures, v.capture_offsets, v.capture_slots,
        channels, *x.stride(), *weight.stride(), *conv_pool.stride(), out.stride(0),
        WIDTH=width, HAS_BIAS=bias is not None, SILU=activation == "silu",
        BLOCK_D=block_d, BLOCK_L=block_l, BLOCK_K=next_pow2(width - 1),
    )  # fmt: skip
    return out
