"""RMS norms in one pass per row: the residual stream's and the Mamba2 mixers' gated one (see norm.c)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..reference.norm import ONE_REDUCTION_MIN_NUMEL, check_args, check_gated_args
from .build import native_build


def supports(x: Tensor, weight: Tensor, gate: Tensor | None = None) -> bool:
    """Whether the norms take these tensors: float32 prefill-sized ones. Below the reference's
    one-reduction size (decode rows) the reference is bit-identical to transformers' modules, which
    the parity tests hold it to; there the native sums' other order would change the last bits."""
    return (
        x.dtype == weight.dtype == torch.float32
        and (gate is None or gate.dtype == torch.float32)
        and x.numel() >= ONE_REDUCTION_MIN_NUMEL
    )


def _rows(t: Tensor) -> Tensor:
    """t [..., D] as [rows, D] with contiguous rows (a view when its layout allows)."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(x: Tensor, weight: Tensor, eps: float, multiply_in_float32: bool = False) -> Tensor:
    """As `reference.norm.rms_norm` for float32 CPU tensors (where `multiply_in_float32` changes nothing)."""
    check_args(x, weight)
    library = native_build().library
    assert library is not None
    rows = _rows(x)
    weight = weight.contiguous()  # a name keeps a copy alive across the call
    out = torch.empty(rows.shape, dtype=x.dtype)
    if rows.shape[0] > 0:
        library.hm_rms_norm_f32(rows.data_ptr(), rows.stride(0), weight.data_ptr(), eps, out.data_ptr(), *rows.shape)
    return out.view(x.shape)


def gated_rms_norm(x: Tensor, gate: Tensor | None, weight: Tensor, eps: float, group_size: int) -> Tensor:
    """As `reference.norm.gated_rms_norm` for float32 CPU tensors."""
    check_gated_args(x, gate, weight, group_size)
    library = native_build().library
    assert library is not None
    rows = _rows(x)
    gates = None if gate is None else _rows(gate)
    weight = weight.contiguous()  # a name keeps a copy alive across the call
    out = torch.empty(rows.shape, dtype=x.dtype)
    if rows.shape[0] > 0:
        library.hm_gated_rms_norm_f32(
            rows.data_ptr(), rows.stride(0), None if gates is None else gates.data_ptr(),
            0 if gates is None else gates.stride(0), weight.data_ptr(), eps, group_size,
            out.data_ptr(), *rows.shape,
        )  # fmt: skip
    return out.view(x.shape)
