"""The common frame of the attention modules whose projections differ from `PagedAttention`'s (gates,
adapters, q/k norms, multipliers): GQA head counts, the q/k/v/output projections under HF's names,
and attention over the paged KV pool."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.layers.linear import Linear
from himamba.services.worker.layers.paged_attend import paged_attend


class ProjectedAttention(nn.Module):
    """Registers `q_proj`, `k_proj`, `v_proj` and the output projection `out_name`; a subclass's
    forward shapes q/k/v per head, applies what its family adds, then calls `attend`.

    `q_per_head`: head-sized q_proj outputs per head (2 for Qwen3-Next's [q | gate]).
    """

    def __init__(
        self,
        in_features: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        device: torch.device,
        dtype: torch.dtype,
        *,
        q_per_head: int = 1,
        out_name: str = "o_proj",
    ) -> None:
        super().__init__()
        if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
            raise ValueError(f"num_key_value_heads ({num_kv_heads}) must divide num_attention_heads ({num_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_proj = Linear(in_features, q_per_head * num_heads * head_dim, bias, device, dtype)
        self.k_proj = Linear(in_features, num_kv_heads * head_dim, bias, device, dtype)
        self.v_proj = Linear(in_features, num_kv_heads * head_dim, bias, device, dtype)
        self.add_module(out_name, Linear(num_heads * head_dim, hidden_size, bias, device, dtype))

    def split_heads(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Projected q [T, Hq*D], k/v [T, Hkv*D] -> [T, Hq, D], [T, Hkv, D], [T, Hkv, D]."""
        tokens = q.shape[0]
        return (
            q.view(tokens, self.num_heads, self.head_dim),
            k.view(tokens, self.num_kv_heads, self.head_dim),
            v.view(tokens, self.num_kv_heads, self.head_dim),
        )

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, batch: ForwardBatch, k_cache: Tensor, v_cache: Tensor, scale: float
    ) -> Tensor:
        """Attention of per-head q/k/v (positions applied) over the paged pool, as [T, Hq*D], ready for
        the output projection; writes the new K/V into the caches."""
        out = paged_attend(q, k, v, batch, k_cache, v_cache, scale)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
