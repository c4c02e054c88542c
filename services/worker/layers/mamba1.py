"""The Mamba1 mixer (Jamba's), reading and writing the recurrent state pool.

Layout (HF names): `in_proj` -> [x | z] (I channels each); depthwise causal `conv1d` + SiLU over x;
`x_proj` -> [dt (R) | B (N) | C (N)], each optionally RMS-normalised (Jamba's `dt_layernorm`,
`b_layernorm`, `c_layernorm`); dt = `dt_proj.weight` @ dt, whose bias is added inside the scan
before the softplus; the selective scan with A = -exp(A_log) [I, N], D skip and gate silu(z);
`out_proj`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from himamba.kernels import (
    causal_conv1d_update,
    causal_conv1d_varlen,
    selective_scan_varlen,
    selective_state_update_mamba1,
)
from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.layers.conv_activation import conv_activation
from himamba.services.worker.layers.linear import Linear
from himamba.services.worker.layers.mamba2 import DepthwiseConv
from himamba.services.worker.layers.norm import RMSNorm
from himamba.services.worker.layers.pool_rows import decode_rows, write_back
from himamba.services.worker.pools import StateComponent


class Mamba1Mixer(nn.Module):
    """A Mamba1 layer over the concatenated tokens of a ForwardBatch.

    State in the pool: "conv" [slots, I, K-1], the last conv inputs, in the model dtype; "ssm"
    [slots, I, N], in float32. A_log and D are kept in float32 whatever the model dtype.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        intermediate_size: int,
        state_size: int,
        dt_rank: int,
        conv_kernel: int,
        device: torch.device,
        dtype: torch.dtype,
        conv_bias: bool = True,
        proj_bias: bool = False,
        inner_norm_eps: float | None = None,
        activation: str = "silu",
    ) -> None:
        """`inner_norm_eps` set: RMS-normalise dt, B and C (Jamba); None: no inner norms."""
        super().__init__()
        self.conv_act = conv_activation(activation)
        if conv_kernel < 2:
            raise ValueError(f"mamba_d_conv must be >= 2, got {conv_kernel}")
        self.intermediate_size = intermediate_size
        self.state_size = state_size
        self.dt_rank = dt_rank
        self.conv_kernel = conv_kernel
        self.dtype = dtype
        self.in_proj = Linear(hidden_size, 2 * intermediate_size, proj_bias, device, dtype)
        self.conv1d = DepthwiseConv(intermediate_size, conv_kernel, conv_bias, device, dtype)
        self.x_proj = Linear(intermediate_size, dt_rank + 2 * state_size, False, device, dtype)
        self.dt_proj = Linear(dt_rank, intermediate_size, True, device, dtype)
        f32 = torch.float32
        self.A_log = nn.Parameter(
            torch.empty(intermediate_size, state_size, device=device, dtype=f32), requires_grad=False
        )
        self.D = nn.Parameter(torch.empty(intermediate_size, device=device, dtype=f32), requires_grad=False)
        self.out_proj = Linear(intermediate_size, hidden_size, proj_bias, device, dtype)
        self.dt_layernorm: RMSNorm | None = None
        self.b_layernorm: RMSNorm | None = None
        self.c_layernorm: RMSNorm | None = None
        if inner_norm_eps is not None:
            self.dt_layernorm = RMSNorm(dt_rank, inner_norm_eps, device, dtype)
            self.b_layernorm = RMSNorm(state_size, inner_norm_eps, device, dtype)
            self.c_layernorm = RMSNorm(state_size, inner_norm_eps, device, dtype)

    def state_components(self) -> tuple[StateComponent, ...]:
        """This layer's entries of the state pool: "conv" (model dtype) and "ssm" (float32)."""
        return (
            StateComponent("conv", (self.intermediate_size, self.conv_kernel - 1), self.dtype),
            StateComponent("ssm", (self.intermediate_size, self.state_size), torch.float32),
        )

    def _ssm_inputs(self, xc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output [..., I] -> dt (before bias and softplus) [..., I], B and C [..., N]."""
        dt, b, c = self.x_proj(xc).split([self.dt_rank, self.state_size, self.state_size], dim=-1)
        if self.dt_layernorm is not None:
            assert self.b_layernorm is not None and self.c_layernorm is not None
            dt, b, c = self.dt_layernorm(dt), self.b_layernorm(b), self.c_layernorm(c)
        return F.linear(dt, self.dt_proj.weight), b, c

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; reads and writes this layer's `state` pool tensors."""
        xs, z = self.in_proj(x).chunk(2, dim=-1)
        weight = self.conv1d.weight.squeeze(1)
        A = -torch.exp(self.A_log)
        dt_bias = self.dt_proj.bias.float()
        if batch.mode == "decode":
            assert batch.state_slots is not None
            slots = batch.state_slots
            # Both kernels update the state they are given in place (pool_rows.decode_rows).
            conv = decode_rows(state["conv"], slots)
            xc = self.conv_act.apply(
                causal_conv1d_update(
                    xs, conv.state, weight, self.conv1d.bias, self.conv_act.fused, conv_state_indices=conv.indices
                )
            )
            write_back(state["conv"], slots, conv)
            dt, b, c = self._ssm_inputs(xc)
            ssm = decode_rows(state["ssm"], slots)
            y = selective_state_update_mamba1(
                ssm.state, xc, dt, A, b, c, D=self.D, z=z, dt_bias=dt_bias, dt_softplus=True,
                state_batch_indices=ssm.indices,
            )  # fmt: skip
            write_back(state["ssm"], slots, ssm)
        else:
            # One conv and one scan for every sequence of the batch (captures and final states included).
            assert batch.state_slots is not None
            v = batch.varlen
            xc = self.conv_act.apply(
                causal_conv1d_varlen(
                    xs, weight, self.conv1d.bias, state["conv"], batch.state_slots, v, self.conv_act.fused
                )
            )
            dt, b, c = self._ssm_inputs(xc)
            y = selective_scan_varlen(xc, dt, A, b, c, self.D, z, dt_bias, True, state["ssm"], batch.state_slots, v)
        return self.out_proj(y)
