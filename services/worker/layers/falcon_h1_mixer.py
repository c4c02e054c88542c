"""FalconH1's Mamba2 mixer: the shared Mamba2 scan with muP multipliers and an optional norm.

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

from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.layers.linear import Linear
from himamba.services.worker.layers.mamba2 import Mamba2Scan


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


class FalconH1Mixer(Mamba2Scan):
    """FalconH1's Mamba2 layer over the concatenated tokens of a ForwardBatch: the shared scan
    between its own projections (muP multipliers) and its optional norm."""

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
        if num_heads * head_dim != intermediate_size:
            raise ValueError(
                f"mamba_d_head ({head_dim}) times mamba_n_heads ({num_heads}) must equal the mamba width "
                f"({intermediate_size})"
            )
        super().__init__(
            num_heads=num_heads, head_dim=head_dim, state_size=state_size, n_groups=n_groups,
            conv_kernel=conv_kernel, chunk_size=chunk_size, dt_limit=dt_limit, conv_bias=conv_bias,
            device=device, dtype=dtype,
        )  # fmt: skip
        self.ssm_in_multiplier = ssm_in_multiplier
        gn = n_groups * state_size
        self.in_proj = Linear(hidden_size, intermediate_size + self.conv_dim + num_heads, in_proj_bias, device, dtype)
        sizes = (intermediate_size, intermediate_size, gn, gn, num_heads)
        mup = torch.cat([torch.full((n,), float(m)) for n, m in zip(sizes, ssm_multipliers, strict=True)])
        self.register_buffer("mup_vector", mup.to(device=device, dtype=dtype), persistent=False)
        self.norm = (
            FalconGatedNorm(intermediate_size, n_groups, norm_eps, norm_before_gate, device, dtype)
            if norm_eps is not None
            else None
        )
        self.out_proj = Linear(intermediate_size, hidden_size, out_proj_bias, device, dtype)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; reads and writes this layer's `state` pool tensors."""
        if self.ssm_in_multiplier != 1.0:
            x = x * self.ssm_in_multiplier
        projected = self.in_proj(x) * self.mup_vector
        gate, xbc, dt = projected.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        y = self.scan(xbc, dt, batch, state)
        y = self.norm(y, gate) if self.norm is not None else y * F.silu(gate)
        return self.out_proj(y)
