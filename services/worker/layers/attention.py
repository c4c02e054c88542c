"""Self-attention over the paged KV pool, with optional rotary embedding and GQA."""

from __future__ import annotations

import torch

from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.layers.partial_rotary import PartialRotaryEmbedding
from himamba.services.worker.layers.projected_attention import ProjectedAttention
from himamba.services.worker.layers.rotary import RotaryEmbedding


class PagedAttention(ProjectedAttention):
    """q/k/v/o projections (HF names) around the paged attention kernels.

    `scale` is the softmax scale (head_dim**-0.5 for most families; Granite's attention_multiplier).
    The new tokens' K/V are written at `batch.write_slots` before attending, so a sequence sees
    its cached prefix and its own new tokens causally.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        bias: bool,
        device: torch.device,
        dtype: torch.dtype,
        rotary: RotaryEmbedding | PartialRotaryEmbedding | None = None,
    ) -> None:
        super().__init__(hidden_size, hidden_size, num_heads, num_kv_heads, head_dim, bias, device, dtype)
        self.scale = scale
        self.rotary = rotary

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """x [T, hidden] (all sequences' new tokens) -> [T, hidden]; writes K/V into the caches."""
        q, k, v = self.split_heads(*self.project_qkv(x))
        if self.rotary is not None:
            q, k = self.rotary(q, k, batch.positions)
        return self.o_proj(self.attend(q, k, v, batch, k_cache, v_cache, self.scale))
