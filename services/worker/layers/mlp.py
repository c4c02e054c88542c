"""Dense feed-forward blocks, named as in HF checkpoints."""

from __future__ import annotations

import torch
from torch import nn

from himamba.services.worker.layers.activation import activation_fn, inplace_activation_fn
from himamba.services.worker.layers.linear import Linear


class MLP(nn.Module):
    """`down_proj(act(up_proj(x)))`, no gate (NemotronH's relu2 MLP and its shared experts)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: str,
        bias: bool,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.act = inplace_activation_fn(activation)  # applied to up_proj's fresh output
        # Column-then-row under tensor parallelism: one all-reduce, in down_proj.
        self.up_proj = Linear(hidden_size, intermediate_size, bias, device, dtype, "column")
        self.down_proj = Linear(intermediate_size, hidden_size, bias, device, dtype, "row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class FusedGatedMLP(nn.Module):
    """`output_linear(act(g) * u)` with `[g | u] = input_linear(x)` in one matrix (Granite's shared_mlp)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: str,
        bias: bool,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.act = activation_fn(activation)
        parts = (intermediate_size, intermediate_size)
        self.input_linear = Linear(hidden_size, 2 * intermediate_size, bias, device, dtype, "column", parts)
        self.output_linear = Linear(intermediate_size, hidden_size, bias, device, dtype, "row")
        self.intermediate_size = self.output_linear.in_features  # this rank's share

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).split(self.intermediate_size, dim=-1)
        return self.output_linear(self.act(gate) * up)
