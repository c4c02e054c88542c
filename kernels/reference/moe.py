"""Mixture-of-experts: routing (which experts, with what weights) and the routed experts' feed-forward.

Routing of token t over E experts, from its router logits r_t [E]:

    s_t      = softmax(r_t) or sigmoid(r_t)                      ("scoring")
    choice_t = s_t + bias                                        (bias only steers the choice)
    groups   : the E experts in n_group equal groups; only the topk_group groups whose two best
               choice scores sum highest stay eligible (n_group = 1: all)
    experts  = top_k of choice_t among eligible experts
    weights  = s_t[experts], / their sum if norm_topk_prob, * routed_scaling_factor

The families as transformers 5 computes them (router logits in float32):
  Qwen3-Next       softmax, norm_topk_prob from config (True in released configs)
  Jamba            softmax, top-2, no renormalisation
  GraniteMoeHybrid softmax over the top-k logits == softmax with norm_topk_prob=True
  NemotronH        sigmoid + e_score_correction_bias, n_group / topk_group, norm_topk_prob,
                   routed_scaling_factor (DeepSeek-V3 style)

Experts: out_t = sum_j weights[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)) for e = experts[t, j]
(plain experts: down_e(act(up_e(x_t)))), weights stacked as transformers 5 stores them:
gate_up [E, 2I, H] (gate rows first), or up [E, I, H]; down [E, H, I].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "relu", "relu2")


class Routing(NamedTuple):
    """Each token's chosen experts and their mixing weights."""

    weights: Tensor  # [T, top_k] float32
    experts: Tensor  # [T, top_k] int64, in descending order of choice score


def moe_route(
    router_logits: Tensor,
    top_k: int,
    scoring: str,
    norm_topk_prob: bool,
    bias: Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    n_group: int = 1,
    topk_group: int = 1,
) -> Routing:
    """Choose top_k experts per token from router_logits [T, E]; see the module docstring.

    bias [E] (e_score_correction_bias) is added to the scores for the choice only. Computed in float32.
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    if n_group < 1 or num_experts % n_group != 0:
        raise ValueError(f"n_group ({n_group}) must divide the number of experts ({num_experts})")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
    per_group = num_experts // n_group
    if not 1 <= top_k <= topk_group * per_group:
        raise ValueError(f"top_k must be in [1, {topk_group * per_group}] (eligible experts), got {top_k}")
    if bias is not None and tuple(bias.shape) != (num_experts,):
        raise ValueError(f"bias must be [E={num_experts}], got {tuple(bias.shape)}")

    logits = router_logits.float()
    if scoring == "softmax" and norm_topk_prob and bias is None and n_group == 1:
        # The softmax renormalised over the top k is the softmax of the top k logits: two ops, not
        # five (what transformers' Granite computes); softmax is monotonic, so the same experts.
        top, experts = logits.topk(top_k, dim=-1)
        weights = top.softmax(-1)
        return Routing(weights if routed_scaling_factor == 1.0 else weights * routed_scaling_factor, experts)
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if n_group > 1:
        grouped = choice.view(-1, n_group, per_group)
        # A group ranks by the sum of its two best experts (its only one, if it has one).
        group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(-1)  # [T, n_group]
        best = group_scores.topk(topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)
    experts = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return Routing(weights, experts)


def activation_of(name: str) -> Callable[[Tensor], Tensor]:
    """The function an `ACTIVATIONS` name stands for."""
    match name:
        case "silu":
            return F.silu
        case "gelu":
            return F.gelu
        case "gelu_pytorch_tanh":
            return lambda x: F.gelu(x, approximate="tanh")
        case "relu":
            return F.relu
        case "relu2":
            return lambda x: F.relu(x).square()
        case _:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")


def moe_experts(
    x: Tensor,
    routing: Routing,
    gate_up_weights: Tensor,
    down_weights: Tensor,
    activation: str,
    gated: bool = True,
) -> Tensor:
    """Apply each token's routed experts to x [T, H] and sum them by routing weight; returns [T, H].

    gate_up_weights [E, 2I, H] (gated: act(gate) * up, gate rows first) or [E, I, H] (gated=False:
    act(up)); down_weights [E, H, I]. Loops over the experts that received tokens, never over
    tokens; each expert runs in x's dtype, the weighted sum accumulates in float32.
    """
    act = activation_of(activation)
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got {tuple(x.shape)}")
    tokens, hidden = x.shape
    if down_weights.dim() != 3 or down_weights.shape[1] != hidden:
        raise ValueError(f"down_weights must be [E, H={hidden}, I], got {tuple(down_weights.shape)}")
    num_experts, _, inter = down_weights.shape
    up_rows = 2 * inter if gated else inter
    if tuple(gate_up_weights.shape) != (num_experts, up_rows, hidden):
        raise ValueError(
            f"gate_up_weights must be [E={num_experts}, {up_rows}, H={hidden}] (gated={gated}), "
            f"got {tuple(gate_up_weights.shape)}"
        )
    check_routing(routing, tokens, num_experts)

    def up_proj(rows: Tensor, expert: int) -> Tensor:
        return F.linear(rows, gate_up_weights[expert])

    def down_proj(h: Tensor, expert: int) -> Tensor:
        return F.linear(h, down_weights[expert])

    return grouped_experts(x, routing, num_experts, inter, act, gated, up_proj, down_proj)


def check_routing(routing: Routing, tokens: int, num_experts: int) -> None:
    """Refuse a routing that is not [tokens, k] weights and int64 experts in [0, num_experts) (reads the
    expert ids: for CPU tensors)."""
    weights, experts = routing
    if experts.dim() != 2 or experts.shape[0] != tokens or weights.shape != experts.shape:
        raise ValueError(
            f"routing must hold weights and experts [T={tokens}, k], "
            f"got {tuple(weights.shape)} and {tuple(experts.shape)}"
        )
    if experts.dtype != torch.int64:
        raise ValueError(f"routing.experts must be int64, got {experts.dtype}")
    if experts.numel():
        lo, hi = (int(v) for v in torch.aminmax(experts))
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"routing.experts must be in [0, E={num_experts}), got min {lo} max {hi}")


def grouped_experts(
    x: Tensor,
    routing: Routing,
    num_experts: int,
    inter: int,
    act: Callable[[Tensor], Tensor],
    gated: bool,
    up_proj: Callable[[Tensor, int], Tensor],
    down_proj: Callable[[Tensor, int], Tensor],
) -> Tensor:
    """The experts' weighted sum over a checked routing, the (token, choice) pairs sorted by expert
    and each expert's rows run as one product: `up_proj(rows, e)` [n, H] -> [n, 2I or I],
    `down_proj(h, e)` [n, I] -> [n, H]."""
    weights, experts = routing
    tokens, hidden = x.shape
    out = torch.zeros(tokens, hidden, dtype=torch.float32, device=x.device)
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)
    token_of = order // experts.shape[1]
    weight_of = weights.reshape(-1).float()[order]
    # One host sync for the per-expert token counts, then static slices.
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = token_of[start : start + count]
        h = up_proj(x.index_select(0, rows), expert)
        if gated:
            gate, up = h.split(inter, dim=-1)
            h = act(gate) * up
        else:
            h = act(h)
        h = down_proj(h, expert)
        out.index_add_(0, rows, h.float() * weight_of[start : start + count, None])
        start += count
    return out.to(x.dtype)
