"""The SwiGLU-style MLP with separate gate / up / down matrices (HF `gate_proj`, `up_proj`, `down_proj`)."""

from __future__ import annotations

import torch
from torch import nn

from himamba.services.worker.layers.activation import activation_fn
from himamba.services.worker.layers.linear import Linear


class GatedMLP(nn.Module):
    """`down_proj(act(gate_proj(x) * gate_multiplier) * up_proj(x)) * down_multiplier`.

    The multipliers are FalconH1's `mlp_multipliers` (1.0 elsewhere: Bamba, Jamba, Qwen3-Next, LFM2).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: str,
        bias: bool,
        device: torch.device,
        dtype: torch.dtype,
        gate_multiplier: float = 1.0,
        down_multiplier: float = 1.0,
    ) -> None:
        super().__init__()
        self.act = activation_fn(activation)
        self.gate_multiplier = gate_multiplier
        self.down_multiplier = down_multiplier
        # Column-then-row under tensor parallelism: one all-reduce, in down_proj.
        self.gate_proj = Linear(hidden_size, intermediate_size, bias, device, dtype, "column")
        self.up_proj = Linear(hidden_size, intermediate_size, bias, device, dtype, "column")
        self.down_proj = Linear(intermediate_size, hidden_size, bias, device, dtype, "row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        if self.gate_multiplier != 1.0:
            gate = gate * self.gate_multiplier
        out = self.down_proj(self.up_proj(x) * self.act(gate))
        if self.down_multiplier != 1.0:
            out = out * self.down_multiplier
        return out
