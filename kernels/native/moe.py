"""The routed experts over weights packed once into the native GEMM's column panels (see linear.py).

Each expert's rows are a product of a few rows (decode: about batch * top_k / E per expert), the
case where `F.linear` (MKL's sgemm) is slowest and the panels help most. Same grouping as
`reference.moe.moe_experts` (pairs sorted by expert, one product per expert that received tokens).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..reference import moe as _ref
from ..reference.moe import Routing
from . import linear as _linear
from .linear import PanelWeight


class PackedExperts(NamedTuple):
    """Experts packed by `pack`: each expert's gate_up (or up) and down weight as panels."""

    up: tuple[PanelWeight, ...]
    down: tuple[PanelWeight, ...]
    gated: bool

    @property
    def intermediate_size(self) -> int:
        return self.down[0].in_features


def supports(gate_up_weights: Tensor, down_weights: Tensor) -> bool:
    """Whether `pack` takes these: float32 CPU [E, rows, H] and [E, H, I] with at least one expert."""
    return all(
        w.device.type == "cpu" and w.dim() == 3 and w.dtype == torch.float32 for w in (gate_up_weights, down_weights)
    ) and (gate_up_weights.shape[0] > 0)


def pack(gate_up_weights: Tensor, down_weights: Tensor, gated: bool) -> PackedExperts:
    """Every expert's weights as panels (a copy; later changes to the weights do not reach it)."""
    if not supports(gate_up_weights, down_weights):
        raise ValueError("pack takes float32 CPU expert weights [E, rows, H] and [E, H, I]")
    return PackedExperts(
        tuple(_linear.pack(w) for w in gate_up_weights), tuple(_linear.pack(w) for w in down_weights), gated
    )


def moe_experts(x: Tensor, routing: Routing, packed: PackedExperts, activation: str) -> Tensor:
    """`reference.moe.moe_experts` over packed weights, for a float32 CPU x [T, H]."""
    act = _ref.activation_of(activation)
    if x.dim() != 2 or x.shape[1] != packed.up[0].in_features:
        raise ValueError(f"x must be [T, H={packed.up[0].in_features}], got {tuple(x.shape)}")
    num_experts = len(packed.up)
    _ref.check_routing(routing, x.shape[0], num_experts)

    def up_proj(rows: Tensor, expert: int) -> Tensor:
        return _linear.linear(rows, packed.up[expert], None)

    def down_proj(h: Tensor, expert: int) -> Tensor:
        return _linear.linear(h, packed.down[expert], None)

    return _ref.grouped_experts(
        x, routing, num_experts, packed.intermediate_size, act, packed.gated, up_proj, down_proj
    )
