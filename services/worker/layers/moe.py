"""Mixture-of-experts building blocks: routers (which experts, what weights) and stacked experts,
all through the kernels' `moe_route` / `moe_experts` (the fused Triton twin on CUDA, a grouped
sorted-by-expert loop on CPU); shared experts are the model layer's own MLP.

Expert weights are stacked 3-D parameters as in transformers 5 checkpoints:
gated experts `gate_up_proj` [E, 2I, H] (act(g) * u, g first) and `down_proj` [E, H, I];
plain experts `up_proj` [E, I, H] and `down_proj` [E, H, I].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from himamba.kernels import Routing, moe_experts, moe_route
from himamba.kernels.dispatch import PackedExperts, pack_experts, packed_moe_experts
from himamba.services.worker.layers.activation import activation_fn
from himamba.services.worker.tensor_parallel import all_reduce, divide, mark, split

# HF config names (`hidden_act`) the kernels know under another name.
_KERNEL_ACTIVATION = {"swish": "silu", "gelu_new": "gelu_pytorch_tanh"}


class SoftmaxTopKRouter(nn.Module):
    """Top-k of the router logits, weights = softmax over those k logits (Granite, Mixtral): the
    same as softmax over all experts, renormalised over the top k."""

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
        return moe_route(F.linear(x, self.weight), self.top_k, "softmax", True)


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
        eligible = topk_group * (num_experts // n_group)
        if not 1 <= top_k <= eligible:
            raise ValueError(
                f"num_experts_per_tok must be in [1, {eligible}] (experts in topk_group groups), got {top_k}"
            )
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
        logits = F.linear(x.float(), self.weight.float())
        return moe_route(
            logits,
            self.top_k,
            "sigmoid",
            self.norm_topk_prob,
            self.e_score_correction_bias,
            self.routed_scaling_factor,
            self.n_group,
            self.topk_group,
        )


class RoutedExperts(nn.Module):
    """`num_experts` feed-forward experts applied to the tokens routed to them, weighted and summed
    (`kernels.moe_experts`; accumulates in float32).

    Under tensor parallelism every rank holds every expert's share of the intermediate rows (tensor
    slicing, as sglang and vLLM do without expert parallelism) and the outputs are summed by one all-reduce.
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
        activation_fn(activation)  # refuses a name no family uses
        self.activation = _KERNEL_ACTIVATION.get(activation, activation)
        self.num_experts = num_experts
        self.gated = gated
        full = intermediate_size
        intermediate_size = divide(intermediate_size, "the experts' intermediate size")
        self.intermediate_size = intermediate_size
        up_rows = 2 * intermediate_size if gated else intermediate_size
        up = nn.Parameter(
            torch.empty(num_experts, up_rows, hidden_size, device=device, dtype=dtype), requires_grad=False
        )
        # HF's names: the fused gate+up matrix is `gate_up_proj`, a plain one `up_proj`.
        self.register_parameter("gate_up_proj" if gated else "up_proj", up)
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, device=device, dtype=dtype), requires_grad=False
        )
        mark(up, split(1, (full, full) if gated else None))
        mark(self.down_proj, split(2))
        self._packed: PackedExperts | None = None  # packed copy of the weights (cpu_packing); not parameters

    def pack_for_cpu(self) -> bool:
        """Use a pre-packed copy of the expert weights (the native CPU products) from now on, where
        that applies; True if packed."""
        self._packed = pack_experts(self._up, self.down_proj, self.gated)
        return self._packed is not None

    @property
    def _up(self) -> torch.Tensor:
        return self.gate_up_proj if self.gated else self.up_proj

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden] in x's dtype."""
        if self._packed is not None:
            return all_reduce(packed_moe_experts(x, routing, self._packed, self.activation))
        return all_reduce(moe_experts(x, routing, self._up, self.down_proj, self.activation, self.gated))
