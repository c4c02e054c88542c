"""RMS normalisation modules over the `himamba.kernels` norm ops."""

from __future__ import annotations

import torch
from torch import nn

from himamba.kernels import gated_rms_norm, rms_norm
from himamba.services.worker.tensor_parallel import all_reduce


class RMSNorm(nn.Module):
    """RMSNorm of the residual stream.

    `multiply_in_float32` picks where the result is rounded to the activation dtype: after the
    weight multiply (NemotronH) or before it (Llama style: Granite, Bamba, Mamba2). It only
    matters below float32.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        device: torch.device,
        dtype: torch.dtype,
        multiply_in_float32: bool = False,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.multiply_in_float32 = multiply_in_float32
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.multiply_in_float32)


class GatedRMSNorm(nn.Module):
    """`norm(x * silu(gate))` over groups of `group_size` channels: the Mamba2 mixer's output norm."""

    def __init__(self, hidden_size: int, group_size: int, eps: float, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        if group_size < 1 or hidden_size % group_size != 0:
            raise ValueError(f"group_size must divide hidden_size={hidden_size}, got {group_size}")
        self.eps = eps
        self.group_size = group_size
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps, self.group_size)


class RanksGatedRMSNorm(nn.Module):
    """`norm(x * silu(gate))` over one group spread across the tensor-parallel ranks (Mamba2 with
    n_groups = 1 under TP): each rank holds `width` of the group's `full_width` channels, and the
    sum of squares is all-reduced before normalising."""

    def __init__(self, width: int, full_width: int, eps: float, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.full_width = full_width
        self.weight = nn.Parameter(torch.empty(width, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        u = x.float() if gate is None else torch.nn.functional.silu(gate.float()).mul_(x)
        square_sum = all_reduce(u.pow(2).sum(-1, keepdim=True))
        normed = u * torch.rsqrt(square_sum / self.full_width + self.eps)
        return (self.weight * normed.to(x.dtype)).to(x.dtype)
