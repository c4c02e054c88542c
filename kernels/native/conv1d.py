"""The causal depthwise conv: a prefill segment, or a packed varlen batch with its captures, with its
activation in one pass (conv_scan.c), and one decode step in one pass over each window (conv_update.c)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..reference.conv1d import ConvResult, check_args, check_update_args, check_varlen_args
from ..varlen import Varlen, host_index, host_slots
from .build import native_build


def supports(x: Tensor, weight: Tensor, bias: Tensor | None, initial_state: Tensor | None) -> bool:
    """Whether `causal_conv1d` takes these tensors: float32, x time-major (its channels contiguous,
    as a projection's rows seen as [B, D, L] are)."""
    tensors = (x, weight, *(t for t in (bias, initial_state) if t is not None))
    return all(t.dtype == torch.float32 for t in tensors) and (x.stride(1) == 1 or x.shape[1] == 1)


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    initial_state: Tensor | None,
    activation: str | None = "silu",
) -> ConvResult:
    """As `reference.conv1d.causal_conv1d` for float32 CPU tensors with time-major x; `out` is a
    [B, D, L] view of a time-major [B, L, D] tensor (as the reference's time-major path returns)."""
    width = check_args(x, weight, bias, initial_state, activation)
    library = native_build().library
    assert library is not None
    batch, channels, length = x.shape
    out = x.new_empty(batch, length, channels)
    final = x.new_empty(batch, channels, width - 1)
    weight = weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    init = None if initial_state is None else initial_state.contiguous()
    status = library.hm_conv_scan_f32(
        x.data_ptr(), x.stride(0), x.stride(2), weight.data_ptr(), None if bias is None else bias.data_ptr(),
        None if init is None else init.data_ptr(), int(activation == "silu"), out.data_ptr(), final.data_ptr(),
        batch, length, channels, width,
    )  # fmt: skip
    if status != 0:
        raise MemoryError("causal_conv1d: out of memory for the taps")
    return ConvResult(out.transpose(1, 2), final)


def supports_varlen(x: Tensor, weight: Tensor, bias: Tensor | None, conv_pool: Tensor) -> bool:
    """Whether `causal_conv1d_varlen` takes these tensors: float32, x's channels contiguous, the pool
    contiguous (its windows are written in place)."""
    tensors = (x, weight, conv_pool) if bias is None else (x, weight, bias, conv_pool)
    return (
        all(t.dtype == torch.float32 for t in tensors)
        and x.dim() == 2
        and (x.stride(1) == 1 or x.shape[1] == 1)
        and conv_pool.is_contiguous()
    )


def causal_conv1d_varlen(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_pool: Tensor,
    state_slots: Tensor,
    v: Varlen,
    activation: str | None = "silu",
) -> Tensor:
    """As `dispatch.causal_conv1d_varlen` for float32 CPU tensors: every sequence in one call, the
    out [T, D] written once, windows read from and written (captures, final) into `conv_pool`; a
    slot outside the pool is a ValueError (nothing is written then)."""
    width = check_varlen_args(x, weight, bias, conv_pool, state_slots, v, activation)
    library = native_build().library
    assert library is not None
    total, channels = x.shape
    out = x.new_empty(total, channels)
    slots, index = host_slots(state_slots, v), host_index(v)  # exactly what was checked, on the host
    weight = weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    status = library.hm_conv_varlen_f32(
        x.data_ptr(), x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(), conv_pool.data_ptr(),
        conv_pool.shape[0], slots.data_ptr(), index.prefix.data_ptr(), index.cu_seqlens.data_ptr(), index.cu_captures.data_ptr(),
        index.capture_offsets.data_ptr(), index.capture_slots.data_ptr(), int(activation == "silu"), out.data_ptr(),
        v.num_seqs, channels, width,
    )  # fmt: skip
    if status == -1:
        raise ValueError(f"state_slots or a capture slot lies outside the pool's {conv_pool.shape[0]} slots")
    if status != 0:
        raise MemoryError("causal_conv1d_varlen: out of memory for the taps")
    return out


def supports_update(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether `causal_conv1d_update` takes these tensors: float32, the state contiguous."""
    tensors = (x, conv_state, weight) if bias is None else (x, conv_state, weight, bias)
    return all(t.dtype == torch.float32 for t in tensors) and conv_state.is_contiguous()


def causal_conv1d_update(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    activation: str | None = "silu",
) -> Tensor:
    """As `reference.conv1d.causal_conv1d_update` (state updated in place) for float32 CPU tensors."""
    width = check_update_args(x, conv_state, weight, bias, activation)
    library = native_build().library
    assert library is not None
    batch, channels = x.shape
    out = x.new_empty(batch, channels)
    if batch == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    library.hm_conv_update_f32(
        x.data_ptr(), x.stride(0), conv_state.data_ptr(), weight.data_ptr(),
        None if bias is None else bias.data_ptr(), int(activation == "silu"), out.data_ptr(),
        batch, channels, width,
    )  # fmt: skip
    return out
