"""FalconH1's Mamba2 mixer: the standard Mamba2 layout with muP multipliers and an optional norm.

Differences from `Mamba2Mixer` (transformers 5.23's FalconH1Mixer): the input is scaled by
`ssm_in_multiplier` and the `in_proj` output by a per-slice muP vector ([z | x | B | C | dt] times
`ssm_multipliers`); the inner width is `mamba_d_ssm`; the output norm exists only with
`mamba_rms_norm` (then grouped, weight applied in float32, gate before or after the norm per
`mamba_norm_before_gate`), otherwise y * silu(z); `out_proj`'s bias is `projectors_bias`; and, as
in transformers, dt is clamped to `time_step_limit` in prefill but not in decode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from himamba.kernels import causal_conv1d, causal_conv1d_update, selective_state_update, ssd_scan
from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.layers.linear import Linear
from himamba.services.worker.layers.mamba2 import DepthwiseConv
from himamba.services.worker.layers.recurrent_segments import State, run_prefill
from himamba.services.worker.pools import StateComponent


class FalconGatedNorm(nn.Module):
    """FalconH1RMSNormGated: grouped RMS norm, weight multiplied in float32, silu(gate) before or after."""

    def __init__(
        self, width: int, n_groups: int, eps: float, norm_before_gate: bool, device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.n_groups = n_groups
        self.eps = eps
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.empty(width, device=device, dtype=dtype), requires_grad=False)

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = y.float()
        if not self.norm_before_gate:
            h = h * F.silu(gate.float())
        grouped = h.view(*h.shape[:-1], self.n_groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        h = (self.weight.view(self.n_groups, -1) * grouped).view(h.shape)
        if self.norm_before_gate:
            h = h * F.silu(gate.float())
        return h.to(y.dtype)


class FalconH1Mixer(nn.Module):
    """FalconH1's Mamba2 layer over the concatenated tokens of a ForwardBatch.

    State in the pool: "conv" [slots, conv_dim, K-1] in the model dtype; "ssm" [slots, H, P, N] in
    float32. A_log, D and dt_bias are kept in float32 whatever the model dtype.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        intermediate_size: int,
        num_heads: int,
        head_dim: int,
        state_size: int,
        n_groups: int,
        conv_kernel: int,
        chunk_size: int,
        device: torch.device,
        dtype: torch.dtype,
        dt_limit: tuple[float, float],
        conv_bias: bool,
        in_proj_bias: bool,
        out_proj_bias: bool,
        ssm_in_multiplier: float,
        ssm_multipliers: tuple[float, float, float, float, float],
        norm_eps: float | None,
        norm_before_gate: bool,
    ) -> None:
        """`norm_eps` None: no output norm (mamba_rms_norm false)."""
        super().__init__()
        if n_groups < 1 or num_heads % n_groups != 0:
            raise ValueError(f"mamba_n_groups ({n_groups}) must divide mamba_n_heads ({num_heads})")
        if num_heads * head_dim != intermediate_size:
            raise ValueError(
                f"mamba_d_head ({head_dim}) times mamba_n_heads ({num_heads}) must equal the mamba width "
                f"({intermediate_size})"
            )
        if conv_kernel < 2:
            raise ValueError(f"mamba_d_conv must be >= 2, got {conv_kernel}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.state_size = state_size
        self.n_groups = n_groups
        self.conv_kernel = conv_kernel
        self.chunk_size = chunk_size
        self.dt_limit = dt_limit
        self.dtype = dtype
        self.intermediate_size = intermediate_size
        self.ssm_in_multiplier = ssm_in_multiplier
        gn = n_groups * state_size
        self.conv_dim = intermediate_size + 2 * gn
        self.in_proj = Linear(hidden_size, intermediate_size + self.conv_dim + num_heads, in_proj_bias, device, dtype)
        sizes = (intermediate_size, intermediate_size, gn, gn, num_heads)
        mup = torch.cat([torch.full((n,), float(m)) for n, m in zip(sizes, ssm_multipliers, strict=True)])
        self.register_buffer("mup_vector", mup.to(device=device, dtype=dtype), persistent=False)
        self.conv1d = DepthwiseConv(self.conv_dim, conv_kernel, conv_bias, device, dtype)
        f32 = torch.float32
        self.dt_bias = nn.Parameter(torch.empty(num_heads, device=device, dtype=f32), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(num_heads, device=device, dtype=f32), requires_grad=False)
        self.D = nn.Parameter(torch.empty(num_heads, device=device, dtype=f32), requires_grad=False)
        self.norm = (
            FalconGatedNorm(intermediate_size, n_groups, norm_eps, norm_before_gate, device, dtype)
            if norm_eps is not None
            else None
        )
        self.out_proj = Linear(intermediate_size, hidden_size, out_proj_bias, device, dtype)

    def state_components(self) -> tuple[StateComponent, ...]:
        """This layer's entries of the state pool: "conv" (model dtype) and "ssm" (float32)."""
        return (
            StateComponent("conv", (self.conv_dim, self.conv_kernel - 1), self.dtype),
            StateComponent("ssm", (self.num_heads, self.head_dim, self.state_size), torch.float32),
        )

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gn = self.n_groups * self.state_size
        return xbc.split([self.intermediate_size, gn, gn], dim=-1)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; reads and writes this layer's `state` pool tensors."""
        if self.ssm_in_multiplier != 1.0:
            x = x * self.ssm_in_multiplier
        projected = self.in_proj(x) * self.mup_vector
        gate, xbc, dt = projected.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        weight = self.conv1d.weight.squeeze(1)
        A = -torch.exp(self.A_log)
        heads, head_dim, groups, n = self.num_heads, self.head_dim, self.n_groups, self.state_size
        if batch.mode == "decode":
            assert batch.state_slots is not None
            slots = batch.state_slots
            size = xbc.shape[0]
            conv_state = state["conv"].index_select(0, slots)
            xbc = causal_conv1d_update(xbc, conv_state, weight, self.conv1d.bias, "silu")
            state["conv"].index_copy_(0, slots, conv_state)
            xs, b, c = self._split_xbc(xbc)
            ssm = state["ssm"].index_select(0, slots)
            y = selective_state_update(
                ssm,
                xs.reshape(size, heads, head_dim),
                dt,
                A,
                b.reshape(size, groups, n),
                c.reshape(size, groups, n),
                D=self.D,
                dt_bias=self.dt_bias,
                dt_softplus=True,
            ).reshape(size, self.intermediate_size)
            state["ssm"].index_copy_(0, slots, ssm)
        else:

            def step(start: int, end: int, carried: State | None) -> tuple[torch.Tensor, State]:
                length = end - start
                conv = causal_conv1d(
                    xbc[start:end].t().unsqueeze(0),
                    weight,
                    self.conv1d.bias,
                    None if carried is None else carried["conv"],
                    "silu",
                )
                xs, b, c = self._split_xbc(conv.out[0].t())
                scan = ssd_scan(
                    xs.reshape(1, length, heads, head_dim),
                    dt[start:end].unsqueeze(0),
                    A,
                    b.reshape(1, length, groups, n),
                    c.reshape(1, length, groups, n),
                    self.chunk_size,
                    D=self.D,
                    dt_bias=self.dt_bias,
                    dt_softplus=True,
                    dt_limit=self.dt_limit,
                    initial_state=None if carried is None else carried["ssm"],
                )
                return scan.y.reshape(length, self.intermediate_size), {
                    "conv": conv.final_state,
                    "ssm": scan.final_state,
                }

            y = run_prefill(batch, state, step)
        if self.norm is not None:
            y = self.norm(y, gate)
        else:
            y = y * F.silu(gate)
        return self.out_proj(y)
