"""The common frame of the attention modules whose projections differ from `PagedAttention`'s (gates,
adapters, q/k norms, multipliers): GQA head counts, the q/k/v/output projections under HF's names,
and attention over the paged KV pool."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.layers.cpu_packing import Packed, can_pack, pack, packed_linear
from himamba.services.worker.layers.linear import Linear
from himamba.services.worker.layers.paged_attend import paged_attend
from himamba.services.worker.tensor_parallel import divide, group, mark, replicated_heads, split


class ProjectedAttention(nn.Module):
    """Registers `q_proj`, `k_proj`, `v_proj` and the output projection `out_name`; a subclass's
    forward shapes q/k/v per head, applies what its family adds, then calls `attend`.

    `q_per_head`: head-sized q_proj outputs per head (2 for Qwen3-Next's [q | gate]).

    Head counts are the full model's; under tensor parallelism this rank keeps its share of the query
    heads and of the KV heads, or, when there are fewer KV heads than ranks, the one its queries read.
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
        full_kv_heads = num_kv_heads
        self.full_heads = num_heads
        n = group().size
        replicate_kv = num_kv_heads < n
        if replicate_kv and n % num_kv_heads:
            raise ValueError(
                f"tensor parallelism: the KV heads ({num_kv_heads}) neither divide by nor divide "
                f"--tensor-parallel-size {n}"
            )
        num_heads = divide(num_heads, "the attention heads")
        num_kv_heads = 1 if replicate_kv else divide(num_kv_heads, "the KV heads")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_proj = Linear(in_features, q_per_head * self.full_heads * head_dim, bias, device, dtype, "column")
        self.k_proj = Linear(in_features, num_kv_heads * head_dim, bias, device, dtype)
        self.v_proj = Linear(in_features, num_kv_heads * head_dim, bias, device, dtype)
        kv_shard = replicated_heads(0, full_kv_heads, head_dim) if replicate_kv else split(0)
        for p in (self.k_proj.weight, self.k_proj.bias, self.v_proj.weight, self.v_proj.bias):
            mark(p, kv_shard)
        out = Linear(self.full_heads * head_dim, hidden_size, bias, device, dtype, parallel="row")
        self.add_module(out_name, out)
        self._qkv_packed: Packed | None = None  # [q | k | v] packed as one weight (pack_for_cpu)
        self._qkv_bias: Tensor | None = None
        self._qkv_sizes = [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features]

    def pack_for_cpu(self) -> bool:
        """Pack q/k/v as one weight (cpu_packing), so that a step runs one product instead of three (a decode
        step's k/v products are too small to use the cores: 2.3x faster at batch 1, 1.6x at 32, equal
        at prefill; 2-core AMD EPYC, medium NemotronH sizes). The three stay modules under HF's names,
        with their plain weights. Runs before the children's own packing (modules() is pre-order)."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if not all(can_pack(p.weight) and p.weight.dtype == self.q_proj.weight.dtype for p in projections):
            return False
        self._qkv_packed = pack(torch.cat([p.weight for p in projections]))
        biases = [p.bias for p in projections]
        self._qkv_bias = None if biases[0] is None else torch.cat([b for b in biases if b is not None])
        for p in projections:
            p.fused_into_parent()
        return True

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q_proj(x), k_proj(x), v_proj(x) (column views of one product when packed)."""
        if self._qkv_packed is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = packed_linear(x, self._qkv_packed, self._qkv_bias).split(self._qkv_sizes, dim=-1)
        return q, k, v

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
