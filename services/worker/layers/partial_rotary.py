"""Rotary embedding over the first `rotary_dim` channels of each head (Bamba, Qwen3-Next)."""

from __future__ import annotations

import torch
from torch import nn

from himamba.services.worker.layers.rotary import RotaryEmbedding


class PartialRotaryEmbedding(nn.Module):
    """HF's rope with `partial_rotary_factor`: the first `rotary_dim` channels of q and k are rotated
    (rotate-half within them, frequencies over rotary_dim), the rest pass through unchanged.
    `inv_freq` / `attention_scaling`: a scaled rope type's frequencies and cos/sin factor."""

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        base: float,
        device: torch.device,
        inv_freq: torch.Tensor | None = None,
        attention_scaling: float = 1.0,
    ) -> None:
        super().__init__()
        if not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim must be in [1, head_dim={head_dim}], got {rotary_dim}")
        self.rotary_dim = rotary_dim
        self.rotary = RotaryEmbedding(rotary_dim, base, device, inv_freq, attention_scaling)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D], positions [T] int64 -> rotated (q, k) in their dtypes."""
        r = self.rotary_dim
        if r == q.shape[-1]:
            return self.rotary(q, k, positions)
        q_rot, k_rot = self.rotary(q[..., :r], k[..., :r], positions)
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
