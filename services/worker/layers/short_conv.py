"""LFM2's gated short convolution, the recurrent layer whose whole state is its conv window.

Layout (HF names): `in_proj` -> [B | C | x]; `conv` a depthwise causal conv of width L_cache (no
activation) over B * x; out = `out_proj`(C * conv(B * x)).
"""

from __future__ import annotations

import torch
from torch import nn

from himamba.kernels import causal_conv1d_update, causal_conv1d_varlen
from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.layers.linear import Linear
from himamba.services.worker.layers.mamba2 import DepthwiseConv
from himamba.services.worker.layers.pool_rows import decode_rows, write_back
from himamba.services.worker.pools import StateComponent


class ShortConv(nn.Module):
    """A gated short conv over the concatenated tokens of a ForwardBatch.

    State in the pool: "conv" [slots, hidden, L_cache - 1], the last conv inputs (B * x), in the
    model dtype.
    """

    def __init__(
        self, hidden_size: int, kernel_size: int, bias: bool, device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__()
        if kernel_size < 2:
            raise ValueError(f"conv_L_cache must be >= 2, got {kernel_size}")
        self.hidden_size = hidden_size
        self.kernel_size = kernel_size
        self.dtype = dtype
        self.in_proj = Linear(hidden_size, 3 * hidden_size, bias, device, dtype)
        self.conv = DepthwiseConv(hidden_size, kernel_size, bias, device, dtype)
        self.out_proj = Linear(hidden_size, hidden_size, bias, device, dtype)

    def state_components(self) -> tuple[StateComponent, ...]:
        """This layer's entry of the state pool: "conv" only."""
        return (StateComponent("conv", (self.hidden_size, self.kernel_size - 1), self.dtype),)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; reads and writes this layer's `state` pool tensors."""
        b, c, xs = self.in_proj(x).chunk(3, dim=-1)
        bx = b * xs
        weight = self.conv.weight.squeeze(1)
        if batch.mode == "decode":
            assert batch.state_slots is not None
            conv = decode_rows(state["conv"], batch.state_slots)
            y = causal_conv1d_update(bx, conv.state, weight, self.conv.bias, None, conv_state_indices=conv.indices)
            write_back(state["conv"], batch.state_slots, conv)
        else:
            # One conv for every sequence of the batch (captures and final states included).
            assert batch.state_slots is not None
            y = causal_conv1d_varlen(bx, weight, self.conv.bias, state["conv"], batch.state_slots, batch.varlen, None)
        return self.out_proj(c * y)
