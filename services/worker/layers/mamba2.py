"""The Mamba2 mixer shared by the hybrid families, reading and writing the recurrent state pool.

Layout (HF names): `in_proj` -> [gate | xBC | dt]; depthwise causal `conv1d` + the config's activation (SiLU in every published checkpoint) over xBC;
xBC -> x [H, P], B and C [G, N]; the SSD recurrence with A = -exp(A_log), D skip and dt_bias;
`norm(y * silu(gate))` over `n_groups` groups; `out_proj`. The knobs that differ between
families are constructor arguments.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from himamba.kernels import (
    causal_conv1d_update,
    causal_conv1d_varlen,
    selective_state_update,
    ssd_scan_varlen,
)
from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.layers.conv_activation import conv_activation
from himamba.services.worker.layers.linear import Linear
from himamba.services.worker.layers.norm import GatedRMSNorm, RanksGatedRMSNorm
from himamba.services.worker.layers.pool_rows import decode_rows, write_back
from himamba.services.worker.pools import StateComponent
from himamba.services.worker.tensor_parallel import divide, group, mark, split


class DepthwiseConv(nn.Module):
    """Weights of the mixer's causal depthwise conv: weight [D, 1, K] (HF's Conv1d layout), bias [D]."""

    def __init__(self, channels: int, kernel_size: int, bias: bool, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(channels, 1, kernel_size, device=device, dtype=dtype), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(channels, device=device, dtype=dtype), requires_grad=False) if bias else None
        )


class Mamba2Scan(nn.Module):
    """The recurrent core of a Mamba2 layer: depthwise causal conv + SiLU over xBC, then the SSD
    recurrence with A = -exp(A_log), D skip and dt_bias, its state in the pool.

    State in the pool (one entry of `StatePool.tensors`): "conv" [slots, conv_dim, K-1] holds the
    last K-1 conv inputs, in the model dtype; "ssm" [slots, H, P, N] the SSM state, in float32.
    A prefill runs every sequence of the batch in one varlen conv and one varlen scan
    (`kernels.varlen`): each from zeros when it has no cached prefix, else from its slot, the state
    copied into capture slots at capture offsets and the final state written to its slot. A_log, D
    and dt_bias are kept in float32 whatever the model dtype. Mixers add the projections, the gate
    and the norm around `scan`.

    Sizes are the full model's; under tensor parallelism this rank keeps its share of the heads and of
    the `n_groups` groups, the conv channels of both, and its state in the pool. With one group (most
    published checkpoints) every rank keeps the group's B and C whole, and the output norm, which spans
    the group, sums its squares across the ranks.
    """

    def __init__(
        self,
        *,
        num_heads: int,
        head_dim: int,
        state_size: int,
        n_groups: int,
        conv_kernel: int,
        chunk_size: int,
        dt_limit: tuple[float, float],
        conv_bias: bool,
        device: torch.device,
        dtype: torch.dtype,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        self.conv_act = conv_activation(activation)
        if n_groups < 1 or num_heads % n_groups != 0:
            raise ValueError(f"n_groups ({n_groups}) must divide the number of mamba heads ({num_heads})")
        if conv_kernel < 2:
            raise ValueError(f"conv_kernel must be >= 2, got {conv_kernel}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        full_width, full_gn = num_heads * head_dim, n_groups * state_size
        self.full_parts = (full_width, full_gn, full_gn)  # the conv channels' blocks, before sharding
        num_heads = divide(num_heads, "the Mamba2 heads")
        self.groups_replicated = group().size > 1 and n_groups == 1
        self.bc_whole = frozenset({1, 2}) if self.groups_replicated else frozenset()  # of (x, B, C)
        if not self.groups_replicated:
            n_groups = divide(n_groups, "the Mamba2 n_groups (or n_groups = 1, replicated)")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.state_size = state_size
        self.n_groups = n_groups
        self.conv_kernel = conv_kernel
        self.chunk_size = chunk_size
        self.dt_limit = dt_limit
        self.dtype = dtype
        self.intermediate_size = num_heads * head_dim
        self.conv_dim = self.intermediate_size + 2 * n_groups * state_size
        self.conv1d = DepthwiseConv(self.conv_dim, conv_kernel, conv_bias, device, dtype)
        f32 = torch.float32
        self.dt_bias = nn.Parameter(torch.empty(num_heads, device=device, dtype=f32), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(num_heads, device=device, dtype=f32), requires_grad=False)
        self.D = nn.Parameter(torch.empty(num_heads, device=device, dtype=f32), requires_grad=False)
        mark(self.conv1d.weight, split(0, self.full_parts, self.bc_whole))
        mark(self.conv1d.bias, split(0, self.full_parts, self.bc_whole))
        for p in (self.dt_bias, self.A_log, self.D):
            mark(p, split(0))

    def state_components(self) -> tuple[StateComponent, ...]:
        """This layer's entries of the state pool: "conv" (model dtype) and "ssm" (float32)."""
        return (
            StateComponent("conv", (self.conv_dim, self.conv_kernel - 1), self.dtype),
            StateComponent("ssm", (self.num_heads, self.head_dim, self.state_size), torch.float32),
        )

    def scan(
        self, xbc: torch.Tensor, dt: torch.Tensor, batch: ForwardBatch, state: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """xBC [T, conv_dim] and dt [T, H] -> y [T, H * P]; reads and writes this layer's `state`."""
        if batch.mode == "decode":
            return self._decode(xbc, dt, batch, state)
        return self._prefill(xbc, dt, batch, state)

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gn = self.n_groups * self.state_size
        return xbc.split([self.intermediate_size, gn, gn], dim=-1)

    def _prefill(
        self, xbc: torch.Tensor, dt: torch.Tensor, batch: ForwardBatch, state: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        # One conv and one scan for every sequence of the batch; both write captures and final states.
        assert batch.state_slots is not None  # check_batch guarantees it for models with recurrent layers
        total, groups, n = xbc.shape[0], self.n_groups, self.state_size
        v = batch.varlen
        conv = causal_conv1d_varlen(
            xbc, self.conv1d.weight.squeeze(1), self.conv1d.bias, state["conv"], batch.state_slots, v,
            self.conv_act.fused,
        )  # fmt: skip
        x, b, c = self._split_xbc(self.conv_act.apply(conv))
        y = ssd_scan_varlen(
            x.reshape(total, self.num_heads, self.head_dim),
            dt,
            -torch.exp(self.A_log),
            b.reshape(total, groups, n),
            c.reshape(total, groups, n),
            self.chunk_size,
            self.D,
            self.dt_bias,
            True,
            self.dt_limit,
            state["ssm"],
            batch.state_slots,
            v,
        )
        return y.reshape(total, self.intermediate_size)

    def _decode(
        self, xbc: torch.Tensor, dt: torch.Tensor, batch: ForwardBatch, state: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        conv_pool, ssm_pool = state["conv"], state["ssm"]
        slots = batch.state_slots
        assert slots is not None
        batch_size = xbc.shape[0]
        # Both kernels update the state they are given in place (pool_rows.decode_rows).
        conv_rows, ssm_rows = decode_rows(conv_pool, slots), decode_rows(ssm_pool, slots)
        weight = self.conv1d.weight.squeeze(1)
        conv = causal_conv1d_update(
            xbc, conv_rows.state, weight, self.conv1d.bias, self.conv_act.fused, conv_state_indices=conv_rows.indices
        )
        x, b, c = self._split_xbc(self.conv_act.apply(conv))
        y = selective_state_update(
            ssm_rows.state,
            x.reshape(batch_size, self.num_heads, self.head_dim),
            dt,
            -torch.exp(self.A_log),
            b.reshape(batch_size, self.n_groups, self.state_size),
            c.reshape(batch_size, self.n_groups, self.state_size),
            D=self.D,
            dt_bias=self.dt_bias,
            dt_softplus=True,
            # No dt_limit here: transformers, mamba_ssm and vLLM clamp dt in the chunked scan only,
            # and their decode step is what our tokens must equal for real checkpoints.
            state_batch_indices=ssm_rows.indices,
        )
        write_back(conv_pool, slots, conv_rows)
        write_back(ssm_pool, slots, ssm_rows)
        return y.reshape(batch_size, self.intermediate_size)


class Mamba2Mixer(Mamba2Scan):
    """A Mamba2 layer over the concatenated tokens of a ForwardBatch: `in_proj` -> [gate | xBC | dt],
    the scan, `norm(y * silu(gate))` over `n_groups` groups, `out_proj`."""

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        state_size: int,
        n_groups: int,
        conv_kernel: int,
        chunk_size: int,
        norm_eps: float,
        device: torch.device,
        dtype: torch.dtype,
        dt_limit: tuple[float, float] = (0.0, math.inf),
        conv_bias: bool = True,
        proj_bias: bool = False,
        activation: str = "silu",
    ) -> None:
        super().__init__(
            num_heads=num_heads, head_dim=head_dim, state_size=state_size, n_groups=n_groups,
            conv_kernel=conv_kernel, chunk_size=chunk_size, dt_limit=dt_limit, conv_bias=conv_bias,
            device=device, dtype=dtype, activation=activation,
        )  # fmt: skip
        width = self.intermediate_size  # this rank's share
        full_width = self.full_parts[0]
        self.in_proj = Linear(
            hidden_size, full_width + sum(self.full_parts) + num_heads, proj_bias, device, dtype,
            parallel="column", parts=(full_width, *self.full_parts, num_heads),
            whole=frozenset(i + 1 for i in self.bc_whole),
        )  # fmt: skip
        self.norm: GatedRMSNorm | RanksGatedRMSNorm
        if self.groups_replicated:
            self.norm = RanksGatedRMSNorm(width, full_width, norm_eps, device, dtype)
        else:
            self.norm = GatedRMSNorm(width, width // self.n_groups, norm_eps, device, dtype)
        mark(self.norm.weight, split(0))
        self.out_proj = Linear(full_width, hidden_size, proj_bias, device, dtype, parallel="row")

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; reads and writes this layer's `state` pool tensors."""
        gate, xbc, dt = self.in_proj(x).split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        return self.out_proj(self.norm(self.scan(xbc, dt, batch, state), gate))
