"""Softmax-over-all-experts top-k routing (Qwen3-Next, Jamba), feeding `RoutedExperts`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from himamba.kernels import Routing, moe_route


class SoftmaxRouter(nn.Module):
    """Router logits `x @ weight.T`; scores softmax over every expert (float32); the top_k scores
    are the weights, renormalised to sum to one when `norm_topk_prob` (Qwen3-Next) and left as
    they are otherwise (Jamba)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, device=device, dtype=dtype), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> Routing:
        return moe_route(F.linear(x, self.weight), self.top_k, "softmax", self.norm_topk_prob)
