"""Rotary position embedding (the "default" rope type: rotate-half, full head dim)."""

from __future__ import annotations

import torch
from torch import nn


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotates q and k by their absolute positions, exactly as HF's default rope does."""

    def __init__(
        self,
        head_dim: int,
        base: float,
        device: torch.device,
        inv_freq: torch.Tensor | None = None,
        attention_scaling: float = 1.0,
    ) -> None:
        """`inv_freq` [head_dim / 2] given: a scaled rope type's frequencies (else the default rope's of
        `base`); `attention_scaling` multiplies cos and sin, as transformers' rotary classes do."""
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        if inv_freq is None:
            # Computed on the CPU like HF does, so the frequencies match it bit for bit on any device.
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        if inv_freq.shape != (head_dim // 2,):
            raise ValueError(f"inv_freq must have {head_dim // 2} entries, got shape {tuple(inv_freq.shape)}")
        self.attention_scaling = attention_scaling
        self.register_buffer("inv_freq", inv_freq.float().to(device), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D], positions [T] int64 -> rotated (q, k) in their dtypes."""
        freqs = positions.to(self.inv_freq.device).float()[:, None] * self.inv_freq  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        cos = cos.to(q.dtype)[:, None, :]  # [T, 1, D]: broadcast over heads
        sin = sin.to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
