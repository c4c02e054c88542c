"""Twins of `reference.norm`: RMSNorm and the gated, grouped RMSNorm, one program per row (group)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..reference import norm as _ref
from .jit_math import next_pow2, silu


@triton.jit
def _norm_kernel(
    x_ptr, gate_ptr, w_ptr, out_ptr,
    group_size, stride_xr, stride_xc, stride_gr, stride_gc, stride_or, eps,
    BLOCK: tl.constexpr, HAS_GATE: tl.constexpr, MUL_F32: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.program_id(1) * group_size + tl.arange(0, BLOCK)
    mask = tl.arange(0, BLOCK) < group_size
    u = tl.load(x_ptr + row * stride_xr + cols * stride_xc, mask=mask, other=0.0).to(tl.float32)
    if HAS_GATE:
        z = tl.load(gate_ptr + row * stride_gr + cols * stride_gc, mask=mask, other=0.0).to(tl.float32)
        u = silu(z) * u
    normed = u * tl.rsqrt(tl.sum(u * u, axis=0) / group_size + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    if MUL_F32:
        y = w * normed
    else:
        # Llama-style: the normalised value is rounded to x's dtype before the weight multiply.
        y = w * normed.to(out_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_or + cols, y.to(out_ty), mask=mask)


def _rows(t: Tensor) -> Tensor:
    """t [..., D] as [R, D], a view whenever the strides allow one (the worker passes 2-d views)."""
    if t.dim() == 1:
        return t.unsqueeze(0)
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def _launch(x: Tensor, gate: Tensor | None, weight: Tensor, eps: float, group_size: int, mul_f32: bool) -> Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    xr, outr = _rows(x), out.view(-1, x.shape[-1])
    gr = xr if gate is None else _rows(gate)
    grid = (xr.shape[0], x.shape[-1] // group_size)
    _norm_kernel[grid](
        xr, gr, weight, outr,
        group_size, xr.stride(0), xr.stride(1), gr.stride(0), gr.stride(1), outr.stride(0), eps,
        BLOCK=next_pow2(group_size), HAS_GATE=gate is not None, MUL_F32=mul_f32,
    )  # fmt: skip
    return out


def rms_norm(x: Tensor, weight: Tensor, eps: float, multiply_in_float32: bool = False) -> Tensor:
    """Twin of `reference.norm.rms_norm`."""
    _ref.check_args(x, weight)
    return _launch(x, None, weight, eps, x.shape[-1], multiply_in_float32)


def gated_rms_norm(x: Tensor, gate: Tensor | None, weight: Tensor, eps: float, group_size: int) -> Tensor:
    """Twin of `reference.norm.gated_rms_norm`."""
    _ref.check_gated_args(x, gate, weight, group_size)
    return _launch(x, gate, weight, eps, group_size, False)
