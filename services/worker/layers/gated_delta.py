"""Qwen3-Next's gated DeltaNet linear attention, reading and writing the recurrent state pool.

Layout (HF names): `in_proj_qkvz` -> per key head [q (Dk) | k (Dk) | v (r*Dv) | z (r*Dv)] with
r = Hv / Hk value heads per key head; `in_proj_ba` -> per key head [b (r) | a (r)]. The conv input
is [q | k | v] (all heads), a depthwise causal `conv1d` + SiLU without bias. Then beta = sigmoid(b),
g = -exp(A_log) * softplus(a + dt_bias), the gated delta rule with L2-normalised q and k, a per-head
RMS norm times silu(z) (`norm`, normalised before the gate), and `out_proj`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from himamba.kernels import (
    causal_conv1d_update,
    causal_conv1d_varlen,
    chunk_gated_delta_rule_varlen,
    recurrent_gated_delta_rule_update,
)
from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.layers.conv_activation import conv_activation
from himamba.services.worker.layers.linear import Linear
from himamba.services.worker.layers.mamba2 import DepthwiseConv
from himamba.services.worker.layers.pool_rows import decode_rows, write_back
from himamba.services.worker.pools import StateComponent
from himamba.services.worker.tensor_parallel import divide, mark, split

# FLA's and transformers' chunk length for the chunked delta rule.
_CHUNK_SIZE = 64


class HeadGatedRMSNorm(nn.Module):
    """RMS norm over each head's Dv channels, times weight (cast first), then times silu(gate) in float32."""

    def __init__(self, head_dim: int, eps: float, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(head_dim, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * normed.to(x.dtype)
        return (out * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """A gated DeltaNet layer over the concatenated tokens of a ForwardBatch.

    State in the pool: "conv" [slots, 2*Hk*Dk + Hv*Dv, K-1], the last conv inputs, in the model
    dtype; "recurrent" [slots, Hv, Dk, Dv], the delta-rule state, in float32. A_log and dt_bias
    are kept in float32 whatever the model dtype.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        norm_eps: float,
        device: torch.device,
        dtype: torch.dtype,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        if num_k_heads < 1 or num_v_heads % num_k_heads != 0:
            raise ValueError(f"linear_num_key_heads ({num_k_heads}) must divide linear_num_value_heads ({num_v_heads})")
        self.conv_act = conv_activation(activation)
        if conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim must be >= 2, got {conv_kernel}")
        # Under tensor parallelism a rank keeps whole key heads with their value heads: the projections
        # are laid out per key head, so a contiguous share of them is a share of both.
        full_key_dim, full_value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        num_k_heads = divide(num_k_heads, "the gated delta key heads")
        num_v_heads = num_k_heads * (num_v_heads // (full_key_dim // head_k_dim))
        self.num_k_heads = num_k_heads
        self.num_v_heads = num_v_heads
        self.head_k_dim = head_k_dim
        self.head_v_dim = head_v_dim
        self.conv_kernel = conv_kernel
        self.dtype = dtype
        self.key_dim = num_k_heads * head_k_dim
        self.value_dim = num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        full_v_heads = full_value_dim // head_v_dim
        self.in_proj_qkvz = Linear(hidden_size, 2 * full_key_dim + 2 * full_value_dim, False, device, dtype, "column")
        self.in_proj_ba = Linear(hidden_size, 2 * full_v_heads, False, device, dtype, "column")
        self.conv1d = DepthwiseConv(self.conv_dim, conv_kernel, False, device, dtype)
        mark(self.conv1d.weight, split(0, (full_key_dim, full_key_dim, full_value_dim)))
        f32 = torch.float32
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads, device=device, dtype=f32), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(num_v_heads, device=device, dtype=f32), requires_grad=False)
        self.norm = HeadGatedRMSNorm(head_v_dim, norm_eps, device, dtype)
        mark(self.dt_bias, split(0))
        mark(self.A_log, split(0))
        self.out_proj = Linear(full_value_dim, hidden_size, False, device, dtype, parallel="row")

    def state_components(self) -> tuple[StateComponent, ...]:
        """This layer's entries of the state pool: "conv" (model dtype) and "recurrent" (float32)."""
        return (
            StateComponent("conv", (self.conv_dim, self.conv_kernel - 1), self.dtype),
            StateComponent("recurrent", (self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32),
        )

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> conv input [T, conv_dim], z [T, Hv, Dv], b and a [T, Hv]."""
        tokens = x.shape[0]
        rep = self.num_v_heads // self.num_k_heads
        dk, dv = self.head_k_dim, self.head_v_dim
        qkvz = self.in_proj_qkvz(x).view(tokens, self.num_k_heads, 2 * dk + 2 * rep * dv)
        q, k, v, z = qkvz.split([dk, dk, rep * dv, rep * dv], dim=-1)
        b, a = self.in_proj_ba(x).view(tokens, self.num_k_heads, 2 * rep).split([rep, rep], dim=-1)
        mixed = torch.cat((q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)), dim=-1)
        return (
            mixed,
            z.reshape(tokens, self.num_v_heads, dv),
            b.reshape(tokens, self.num_v_heads),
            a.reshape(tokens, self.num_v_heads),
        )

    def _split_heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output [..., conv_dim] -> q, k [..., Hk, Dk] and v [..., Hv, Dv]."""
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        lead = mixed.shape[:-1]
        return (
            q.reshape(*lead, self.num_k_heads, self.head_k_dim),
            k.reshape(*lead, self.num_k_heads, self.head_k_dim),
            v.reshape(*lead, self.num_v_heads, self.head_v_dim),
        )

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; reads and writes this layer's `state` pool tensors."""
        mixed, z, b, a = self._project(x)
        beta = b.sigmoid()
        g = -self.A_log.exp() * F.softplus(a.float() + self.dt_bias)
        weight = self.conv1d.weight.squeeze(1)
        if batch.mode == "decode":
            assert batch.state_slots is not None
            slots = batch.state_slots
            # Both kernels update the state they are given in place (pool_rows.decode_rows).
            conv = decode_rows(state["conv"], slots)
            conv_out = self.conv_act.apply(
                causal_conv1d_update(
                    mixed, conv.state, weight, None, self.conv_act.fused, conv_state_indices=conv.indices
                )
            )
            write_back(state["conv"], slots, conv)
            q, k, v = self._split_heads(conv_out)
            rec = decode_rows(state["recurrent"], slots)
            out = recurrent_gated_delta_rule_update(
                q, k, v, g, beta, rec.state, use_qk_l2norm=True, state_batch_indices=rec.indices
            )
            write_back(state["recurrent"], slots, rec)
        else:
            # One conv and one delta rule for every sequence of the batch (captures and final states included).
            assert batch.state_slots is not None
            v = batch.varlen
            conv_out = self.conv_act.apply(
                causal_conv1d_varlen(mixed, weight, None, state["conv"], batch.state_slots, v, self.conv_act.fused)
            )
            q, k, val = self._split_heads(conv_out)
            out = chunk_gated_delta_rule_varlen(
                q, k, val, g, beta, _CHUNK_SIZE, state["recurrent"], batch.state_slots, v, use_qk_l2norm=True
            )
        out = self.norm(out, z)
        return self.out_proj(out.reshape(x.shape[0], self.value_dim))
