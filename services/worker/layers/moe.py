"""Mixture-of-experts building blocks: routers (which experts, what weights) and stacked experts.

Expert weights are stacked 3-D parameters as in transformers 5 checkpoints:
gated experts `gate_up_proj` [E, 2I, H] (act(g) * u, g first) and `down_proj` [E, H, I];
plain experts `up_proj` [E, I, H] and `down_proj` [E, H, I].
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from himamba.services.worker.layers.activation import activation_fn


class Routing(NamedTuple):
    """Each token's chosen experts and their mixing weights."""

    expert_ids: torch.Tensor  # [T, top_k] int64
    weights: torch.Tensor  # [T, top_k] float32


class SoftmaxTopKRouter(nn.Module):
    """Top-k of the router logits, weights = softmax over those k logits (Granite, Mixtral)."""

    def __init__(
        self, hidden_size: int, num_experts: int, top_k: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
        self.top_k = top_k
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, device=device, dtype=dtype), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> Routing:
        logits = F.linear(x, self.weight).float()
        top_logits, top_ids = logits.topk(self.top_k, dim=-1)
        return Routing(top_ids, torch.softmax(top_logits, dim=-1))


class SigmoidGroupTopKRouter(nn.Module):
    """DeepSeek-V3 style routing (NemotronH): sigmoid scores plus a selection-only bias, experts
    restricted to the best `topk_group` of `n_group` groups, weights optionally renormalised and
    scaled by `routed_scaling_factor`. Computed in float32."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        n_group: int,
        topk_group: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        if n_group < 1 or num_experts % n_group != 0:
            raise ValueError(f"n_group ({n_group}) must divide the number of experts ({num_experts})")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.n_group = n_group
        self.topk_group = topk_group
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, device=device, dtype=dtype), requires_grad=False
        )
        self.e_score_correction_bias = nn.Parameter(
            torch.empty(num_experts, device=device, dtype=torch.float32), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> Routing:
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias
        per_group = self.num_experts // self.n_group
        grouped = choice.view(-1, self.n_group, per_group)
        # A group is ranked by the sum of its two best experts (its only one, if it has one).
        group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(-1)  # [T, n_group]
        best_groups = group_scores.topk(self.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
        top_ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, top_ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return Routing(top_ids, weights * self.routed_scaling_factor)


class RoutedExperts(nn.Module):
    """`num_experts` feed-forward experts applied to the tokens routed to them, weighted and summed.

    Loops over the experts that received tokens (not over tokens); accumulates in float32.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: str,
        gated: bool,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gated = gated
        self.intermediate_size = intermediate_size
        self.act = activation_fn(activation)
        up_rows = 2 * intermediate_size if gated else intermediate_size
        up = nn.Parameter(
            torch.empty(num_experts, up_rows, hidden_size, device=device, dtype=dtype), requires_grad=False
        )
        # HF's names: the fused gate+up matrix is `gate_up_proj`, a plain one `up_proj`.
        self.register_parameter("gate_up_proj" if gated else "up_proj", up)
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, device=device, dtype=dtype), requires_grad=False
        )

    @property
    def _up(self) -> torch.Tensor:
        return self.gate_up_proj if self.gated else self.up_proj

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden] in x's dtype."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        flat_ids = routing.expert_ids.reshape(-1)
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        token_of = order // routing.expert_ids.shape[1]
        weight_of = routing.weights.reshape(-1)[order]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            tokens = token_of[start : start + count]
            h = F.linear(x[tokens], self._up[expert])
            if self.gated:
                gate, up = h.split(self.intermediate_size, dim=-1)
                h = self.act(gate) * up
            else:
                h = self.act(h)
            h = F.linear(h, self.down_proj[expert])
            out.index_add_(0, tokens, h.float() * weight_of[start : start + count, None])
            start += count
        return out.to(x.dtype)
