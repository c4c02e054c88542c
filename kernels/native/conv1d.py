"""One decode step of the causal depthwise conv in one pass over each window (see conv_update.c)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..reference.conv1d import check_update_args
from .build import native_build


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
