"""Self-attention over the paged KV pool, with optional rotary embedding and GQA."""

from __future__ import annotations

import torch
from torch import nn

from himamba.kernels import paged_attention_decode, paged_attention_prefill, write_kv
from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.layers.linear import Linear
from himamba.services.worker.layers.rotary import RotaryEmbedding


class PagedAttention(nn.Module):
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
        rotary: RotaryEmbedding | None = None,
    ) -> None:
        super().__init__()
        if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
            raise ValueError(f"num_key_value_heads ({num_kv_heads}) must divide num_attention_heads ({num_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.q_proj = Linear(hidden_size, num_heads * head_dim, bias, device, dtype)
        self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, bias, device, dtype)
        self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, bias, device, dtype)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias, device, dtype)
        self.rotary = rotary

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """x [T, hidden] (all sequences' new tokens) -> [T, hidden]; writes K/V into the caches."""
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary(q, k, batch.positions)
        write_kv(k_cache, v_cache, batch.write_slots, k, v)
        if batch.mode == "decode":
            out = paged_attention_decode(q, k_cache, v_cache, batch.slot_table, batch.seq_lens, self.scale)
        else:
            outs = []
            start = 0
            for i, n in enumerate(batch.new_lens):
                outs.append(
                    paged_attention_prefill(
                        q[start : start + n], k_cache, v_cache, batch.seq_slots[i], batch.prefix_lens[i], self.scale
                    )
                )
                start += n
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))
