"""Twins of `reference.state_rows`: one program per (row, block of the row) copies a pool row out or in.

Pool rows are contiguous (the state pool allocates each component as one tensor); the batch side
may be an expanded view (one state written to several capture slots) through its row stride.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..reference import state_rows as _ref
from .jit_math import next_pow2


@triton.jit
def _copy_rows_kernel(src_ptr, dst_ptr, slots_ptr, row_len, s_src, s_dst, GATHER: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < row_len
    slot = tl.load(slots_ptr + i)
    if GATHER:
        src_row, dst_row = slot, i
    else:
        src_row, dst_row = i, slot
    vals = tl.load(src_ptr + src_row * s_src + cols, mask=mask)
    tl.store(dst_ptr + dst_row * s_dst + cols, vals.to(dst_ptr.dtype.element_ty), mask=mask)


def _rows_view(t: Tensor) -> Tensor | None:
    """t [B, *row] as [B, row_len] when each row is contiguous (any row stride, 0 included)."""
    if t.dim() == 1:
        return t.unsqueeze(1)
    return t.flatten(1) if t[:1].is_contiguous() else None


def _launch(src: Tensor, dst: Tensor, slots: Tensor, gather: bool) -> None:
    row_len = dst[0].numel() if dst.shape[0] else 0
    if slots.shape[0] == 0 or row_len == 0:
        return
    block = min(2048, next_pow2(row_len))
    _copy_rows_kernel[(slots.shape[0], triton.cdiv(row_len, block))](
        src, dst, slots, row_len, src.stride(0), dst.stride(0), GATHER=gather, BLOCK=block
    )


def gather_state_rows(pool: Tensor, slots: Tensor) -> Tensor:
    """Twin of `reference.state_rows.gather_state_rows`."""
    _ref._check_slots(pool, slots)
    out = torch.empty((slots.shape[0], *pool.shape[1:]), dtype=pool.dtype, device=pool.device)
    source = _rows_view(pool)
    if source is None:
        return _ref.gather_state_rows(pool, slots)  # a pool view with gaps inside rows: rare, keep it exact
    _launch(source, out.view(slots.shape[0], -1) if out.dim() > 1 else out.unsqueeze(1), slots, True)
    return out


def scatter_state_rows(pool: Tensor, slots: Tensor, rows: Tensor) -> None:
    """Twin of `reference.state_rows.scatter_state_rows`."""
    _ref._check_slots(pool, slots)
    if tuple(rows.shape) != (slots.shape[0], *pool.shape[1:]):
        raise ValueError(f"rows must be {[slots.shape[0], *pool.shape[1:]]}, got {tuple(rows.shape)}")
    target, source = _rows_view(pool), _rows_view(rows)
    if target is None or source is None:
        _ref.scatter_state_rows(pool, slots, rows)
        return
    _launch(source, target, slots, False)
