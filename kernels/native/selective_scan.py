"""Mamba1's selective scan of a packed varlen prefill batch, with its captures, in one parallel region
(selective_scan.c)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..reference.selective_scan import check_varlen_args
from ..varlen import Varlen, host_index, host_slots
from .build import native_build


def _rows(t: Tensor) -> Tensor:
    """t [T, K] with its K contiguous (any token stride), copied only when they are not."""
    return t if t.stride(1) == 1 or t.shape[1] == 1 else t.contiguous()


def supports_varlen(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, ssm_pool: Tensor, *others: Tensor | None
) -> bool:
    """Whether `selective_scan_varlen` takes these tensors: float32, the pool contiguous (written in place)."""
    tensors = (u, delta, A, B, C, ssm_pool, *(t for t in others if t is not None))
    return all(t.dtype == torch.float32 for t in tensors) and ssm_pool.is_contiguous()


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
    """As `dispatch.selective_scan_varlen` for float32 CPU tensors: every sequence in one parallel
    region, y written once, states read from and written (captures, final) into `ssm_pool`. A slot
    outside the pool is a ValueError (nothing is written then)."""
    state_size = check_varlen_args(u, delta, A, B, C, D, z, delta_bias, ssm_pool, state_slots, v)
    library = native_build().library
    assert library is not None
    total, channels = u.shape
    y = u.new_empty(total, channels)
    u, delta = _rows(u), _rows(delta)
    z = None if z is None else _rows(z)
    B, C = _rows(B), _rows(C)
    if B.stride(0) != C.stride(0):
        B, C = B.contiguous(), C.contiguous()
    A, D, delta_bias = (
        A.contiguous(),
        None if D is None else D.contiguous(),
        None if delta_bias is None else delta_bias.contiguous(),
    )
    slots, index = host_slots(state_slots, v), host_index(v)  # exactly what was checked, on the host
    status = library.hm_selective_scan_varlen_f32(
        u.data_ptr(), u.stride(0), delta.data_ptr(), delta.stride(0), A.data_ptr(), B.data_ptr(), C.data_ptr(),
        B.stride(0), None if D is None else D.data_ptr(), None if delta_bias is None else delta_bias.data_ptr(),
        int(delta_softplus), None if z is None else z.data_ptr(), 0 if z is None else z.stride(0),
        ssm_pool.data_ptr(), ssm_pool.shape[0], slots.data_ptr(), index.prefix.data_ptr(), index.cu_seqlens.data_ptr(),
        index.cu_captures.data_ptr(), index.capture_offsets.data_ptr(), index.capture_slots.data_ptr(), y.data_ptr(),
        v.num_seqs, channels, state_size,
    )  # fmt: skip
    if status == -1:
        raise ValueError(f"state_slots or a capture slot lies outside the pool's {ssm_pool.shape[0]} slots")
    if status != 0:
        raise MemoryError("selective_scan_varlen: out of memory for the states")
    return y
