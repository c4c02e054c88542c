"""One decode step of Mamba2's recurrence in one pass over the state (see state_update.c)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .build import native_build


def _rows(t: Tensor) -> bool:
    """Whether t [Bt, ...] is contiguous within each row (its rows may lie apart, as views into a projection)."""
    return t[0].is_contiguous() if t.shape[0] > 0 else True


def supports(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *others: Tensor | None) -> bool:
    """Whether `selective_state_update` takes these tensors: all float32 on the CPU, the state contiguous."""
    tensors = (state, x, dt, A, B, C, *(t for t in others if t is not None))
    return all(t.dtype == torch.float32 for t in tensors) and state.is_contiguous()


def selective_state_update(
    state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    dt_bias: Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
) -> Tensor:
    """As `reference.ssd.selective_state_update`, whose argument checks the caller has run."""
    library = native_build().library
    assert library is not None
    batch, heads, head_dim = x.shape
    groups, state_size = B.shape[1], B.shape[2]
    y = x.new_empty(batch, heads, head_dim)
    if batch == 0:
        return y
    x = x if _rows(x) else x.contiguous()
    dt = dt if _rows(dt) else dt.contiguous()
    if not (_rows(B) and _rows(C) and B.stride(0) == C.stride(0)):
        B, C = B.contiguous(), C.contiguous()
    A, D, dt_bias = A.contiguous(), None if D is None else D.contiguous(), None if dt_bias is None else dt_bias.contiguous()
    low, high = dt_limit
    library.hm_ssd_state_update_f32(
        state.data_ptr(), x.data_ptr(), x.stride(0), dt.data_ptr(), dt.stride(0), A.data_ptr(), B.data_ptr(),
        C.data_ptr(), B.stride(0), None if D is None else D.data_ptr(),
        None if dt_bias is None else dt_bias.data_ptr(), int(dt_softplus), low, high,
        int((low, high) != (0.0, math.inf)), y.data_ptr(), batch, heads, head_dim, groups, state_size,
    )  # fmt: skip
    return y
