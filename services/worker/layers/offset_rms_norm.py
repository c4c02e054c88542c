"""RMSNorm whose weight is stored as an offset from one (Qwen3-Next's `Qwen3NextRMSNorm`)."""

from __future__ import annotations

import torch
from torch import nn

from himamba.kernels import rms_norm


class OffsetRMSNorm(nn.Module):
    """`normalise(x) * (1 + weight)` over the last dim, multiplied in float32 then cast to x's dtype.

    Checkpoints store `weight` near zero (its init); the scale is 1 + weight.
    """

    def __init__(self, hidden_size: int, eps: float, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, 1.0 + self.weight.float(), self.eps, multiply_in_float32=True)
