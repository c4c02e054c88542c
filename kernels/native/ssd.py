"""Mamba2's recurrence: the chunked scan of a prefill (a batch, or a packed varlen batch with its captures)
in one parallel region (chunk_scan.c), and one decode step in one pass over the state (state_update.c)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..reference.ssd import (
    ScanResult,
    check_dt_limit,
    check_scan_args,
    check_state_update_args,
    check_varlen_scan_args,
    chunk_length,
    max_chunk_length,
)
from ..varlen import Varlen, host_index, host_slots
from .build import native_build


def _float32(*tensors: Tensor | None) -> bool:
    return all(t.dtype == torch.float32 for t in tensors if t is not None)


def _inner_contiguous(t: Tensor, dims: int) -> bool:
    """Whether t's last `dims` dims are laid out contiguously (its outer dims may have any strides,
    as views into the rows of one projection's output have)."""
    expected = 1
    for size, stride in zip(reversed(t.shape[-dims:]), reversed(t.stride()[-dims:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _clamps(dt_limit: tuple[float, float]) -> int:
    return int(tuple(dt_limit) != (0.0, math.inf))


def supports_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *others: Tensor | None) -> bool:
    """Whether `ssd_scan` takes these tensors (float32, the ones it reads and the initial state)."""
    return _float32(x, dt, A, B, C, *others)


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
    """As `reference.ssd.ssd_scan` (the same chunks, checks and result) for float32 CPU tensors."""
    check_scan_args(x, dt, A, B, C, chunk_size, D, dt_bias, initial_state)
    check_dt_limit(dt_limit)
    library = native_build().library
    assert library is not None
    batch, length, heads, head_dim = x.shape
    groups, state_size = B.shape[2], B.shape[3]
    y = x.new_empty(batch, length, heads, head_dim)
    if length == 0:
        final = x.new_zeros(batch, heads, head_dim, state_size) if initial_state is None else initial_state.clone()
        return ScanResult(y, final)
    x = x if _inner_contiguous(x, 2) else x.contiguous()
    dt = dt if _inner_contiguous(dt, 1) else dt.contiguous()
    if not (_inner_contiguous(B, 2) and _inner_contiguous(C, 2) and B.stride()[:2] == C.stride()[:2]):
        B, C = B.contiguous(), C.contiguous()
    A, D, dt_bias = (
        A.contiguous(),
        None if D is None else D.contiguous(),
        None if dt_bias is None else dt_bias.contiguous(),
    )
    init = None if initial_state is None else initial_state.contiguous()
    final = x.new_empty(batch, heads, head_dim, state_size)
    low, high = dt_limit
    status = library.hm_ssd_scan_f32(
        x.data_ptr(), x.stride(0), x.stride(1), dt.data_ptr(), dt.stride(0), dt.stride(1), A.data_ptr(),
        B.data_ptr(), C.data_ptr(), B.stride(0), B.stride(1), None if D is None else D.data_ptr(),
        None if dt_bias is None else dt_bias.data_ptr(), int(dt_softplus), low, high, _clamps(dt_limit),
        None if init is None else init.data_ptr(), y.data_ptr(), final.data_ptr(), batch, length, heads,
        head_dim, groups, state_size, chunk_length(length, chunk_size, x.device),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("ssd_scan: out of memory for the chunk products")
    return ScanResult(y, final)


def supports_scan_varlen(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, ssm_pool: Tensor, *others: Tensor | None
) -> bool:
    """Whether `ssd_scan_varlen` takes these tensors: float32, the pool contiguous (written in place)."""
    return _float32(x, dt, A, B, C, ssm_pool, *others) and ssm_pool.is_contiguous()


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
    """As `dispatch.ssd_scan_varlen` for float32 CPU tensors: every sequence in one parallel region, y
    written once, states read from and written (captures, final) into `ssm_pool`; each segment
    between capture offsets is chunked as `ssd_scan` would chunk it. A slot outside the pool is a
    ValueError (nothing is written then)."""
    check_varlen_scan_args(x, dt, A, B, C, chunk_size, D, dt_bias, ssm_pool, state_slots, v)
    check_dt_limit(dt_limit)
    library = native_build().library
    assert library is not None
    total, heads, head_dim = x.shape
    groups, state_size = B.shape[1], B.shape[2]
    y = x.new_empty(total, heads, head_dim)
    x = x if _inner_contiguous(x, 2) else x.contiguous()
    dt = dt if _inner_contiguous(dt, 1) else dt.contiguous()
    if not (_inner_contiguous(B, 2) and _inner_contiguous(C, 2) and B.stride(0) == C.stride(0)):
        B, C = B.contiguous(), C.contiguous()
    A, D, dt_bias = (
        A.contiguous(),
        None if D is None else D.contiguous(),
        None if dt_bias is None else dt_bias.contiguous(),
    )
    slots, index = host_slots(state_slots, v), host_index(v)  # exactly what was checked, on the host
    low, high = dt_limit
    status = library.hm_ssd_scan_varlen_f32(
        x.data_ptr(), x.stride(0), dt.data_ptr(), dt.stride(0), A.data_ptr(), B.data_ptr(), C.data_ptr(),
        B.stride(0), None if D is None else D.data_ptr(), None if dt_bias is None else dt_bias.data_ptr(),
        int(dt_softplus), low, high, _clamps(dt_limit), ssm_pool.data_ptr(), ssm_pool.shape[0], slots.data_ptr(),
        index.prefix.data_ptr(), index.cu_seqlens.data_ptr(), index.cu_captures.data_ptr(), index.capture_offsets.data_ptr(),
        index.capture_slots.data_ptr(), y.data_ptr(), v.num_seqs, heads, head_dim, groups, state_size,
        max_chunk_length(chunk_size, x.device),
    )  # fmt: skip
    if status == -1:
        raise ValueError(f"state_slots or a capture slot lies outside the pool's {ssm_pool.shape[0]} slots")
    if status != 0:
        raise MemoryError("ssd_scan_varlen: out of memory for the chunk products")
    return y


def supports_state_update(
    state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *others: Tensor | None
) -> bool:
    """Whether `selective_state_update` takes these tensors: float32, the state contiguous."""
    return _float32(state, x, dt, A, B, C, *others) and state.is_contiguous()


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
) -> Tensor:
    """As `reference.ssd.selective_state_update` (state updated in place) for float32 CPU tensors."""
    check_state_update_args(state, x, dt, A, B, C, D, dt_bias)
    check_dt_limit(dt_limit)
    library = native_build().library
    assert library is not None
    batch, heads, head_dim = x.shape
    groups, state_size = B.shape[1], B.shape[2]
    y = x.new_empty(batch, heads, head_dim)
    if batch == 0:
        return y
    x = x if _inner_contiguous(x, 2) else x.contiguous()
    dt = dt if _inner_contiguous(dt, 1) else dt.contiguous()
    if not (_inner_contiguous(B, 2) and _inner_contiguous(C, 2) and B.stride(0) == C.stride(0)):
        B, C = B.contiguous(), C.contiguous()
    A, D, dt_bias = (
        A.contiguous(),
        None if D is None else D.contiguous(),
        None if dt_bias is None else dt_bias.contiguous(),
    )
    low, high = dt_limit
    library.hm_ssd_state_update_f32(
        state.data_ptr(), x.data_ptr(), x.stride(0), dt.data_ptr(), dt.stride(0), A.data_ptr(), B.data_ptr(),
        C.data_ptr(), B.stride(0), None if D is None else D.data_ptr(),
        None if dt_bias is None else dt_bias.data_ptr(), int(dt_softplus), low, high, _clamps(dt_limit),
        y.data_ptr(), batch, heads, head_dim, groups, state_size,
    )  # fmt: skip
    return y
