"""The Mamba2 mixer shared by the hybrid families, reading and writing the recurrent state pool.

Layout (HF names): `in_proj` -> [gate | xBC | dt]; depthwise causal `conv1d` + SiLU over xBC;
xBC -> x [H, P], B and C [G, N]; the SSD recurrence with A = -exp(A_log), D skip and dt_bias;
`norm(y * silu(gate))` over `n_groups` groups; `out_proj`. The knobs that differ between
families are constructor arguments.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from himamba.kernels import causal_conv1d, causal_conv1d_update, selective_state_update, ssd_scan
from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.layers.linear import Linear
from himamba.services.worker.layers.norm import GatedRMSNorm
from himamba.services.worker.layers.pool_rows import consecutive_rows
from himamba.services.worker.pools import StateComponent


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


class Mamba2Mixer(nn.Module):
    """A Mamba2 layer over the concatenated tokens of a ForwardBatch.

    State in the pool (one entry of `StatePool.tensors`): "conv" [slots, conv_dim, K-1] holds the
    last K-1 conv inputs, in the model dtype; "ssm" [slots, H, P, N] the SSM state, in float32.
    A sequence with prefix_len 0 starts from zeros (its slot is not read); every sequence's final
    state is written to its slot, and captured states to the capture slots.
    A_log, D and dt_bias are kept in float32 whatever the model dtype.
    """

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
        super().__init__()
        if n_groups < 1 or num_heads % n_groups != 0:
            raise ValueError(f"n_groups ({n_groups}) must divide the number of mamba heads ({num_heads})")
        if activation != "silu":
            raise ValueError(f"the Mamba2 conv activation must be 'silu', got {activation!r}")
        if conv_kernel < 2:
            raise ValueError(f"conv_kernel must be >= 2, got {conv_kernel}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
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
        self.in_proj = Linear(hidden_size, self.intermediate_size + self.conv_dim + num_heads, proj_bias, device, dtype)
        self.conv1d = DepthwiseConv(self.conv_dim, conv_kernel, conv_bias, device, dtype)
        f32 = torch.float32
        self.dt_bias = nn.Parameter(torch.empty(num_heads, device=device, dtype=f32), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(num_heads, device=device, dtype=f32), requires_grad=False)
        self.D = nn.Parameter(torch.empty(num_heads, device=device, dtype=f32), requires_grad=False)
        self.norm = GatedRMSNorm(self.intermediate_size, self.intermediate_size // n_groups, norm_eps, device, dtype)
        self.out_proj = Linear(self.intermediate_size, hidden_size, proj_bias, device, dtype)

    def state_components(self) -> tuple[StateComponent, ...]:
        """This layer's entries of the state pool: "conv" (model dtype) and "ssm" (float32)."""
        return (
            StateComponent("conv", (self.conv_dim, self.conv_kernel - 1), self.dtype),
            StateComponent("ssm", (self.num_heads, self.head_dim, self.state_size), torch.float32),
        )

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; reads and writes this layer's `state` pool tensors."""
        gate, xbc, dt = self.in_proj(x).split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        if batch.mode == "decode":
            y = self._decode(xbc, dt, batch, state)
        else:
            y = self._prefill(xbc, dt, batch, state)
        return self.out_proj(self.norm(y, gate))

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gn = self.n_groups * self.state_size
        return xbc.split([self.intermediate_size, gn, gn], dim=-1)

    def _prefill(
        self, xbc: torch.Tensor, dt: torch.Tensor, batch: ForwardBatch, state: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        conv_pool, ssm_pool = state["conv"], state["ssm"]
        weight = self.conv1d.weight.squeeze(1)
        A = -torch.exp(self.A_log)
        heads, head_dim, groups, n = self.num_heads, self.head_dim, self.n_groups, self.state_size
        ys: list[torch.Tensor] = []
        start = 0
        for i, new_len in enumerate(batch.new_lens):
            slot = batch.state_slots[i : i + 1]
            conv_state = conv_pool.index_select(0, slot) if batch.prefix_lens[i] > 0 else None
            ssm_state = ssm_pool.index_select(0, slot) if batch.prefix_lens[i] > 0 else None
            captures = batch.captures[i] if batch.captures else []
            # Run the sequence in segments ending at each capture offset, carrying the state.
            cuts = sorted({c.offset for c in captures} | {new_len})
            seg_start = 0
            for cut in cuts:
                seg_xbc = xbc[start + seg_start : start + cut]
                length = cut - seg_start
                conv = causal_conv1d(seg_xbc.t().unsqueeze(0), weight, self.conv1d.bias, conv_state, "silu")
                seg_x, seg_b, seg_c = self._split_xbc(conv.out[0].t())
                scan = ssd_scan(
                    seg_x.reshape(1, length, heads, head_dim),
                    dt[start + seg_start : start + cut].unsqueeze(0),
                    A,
                    seg_b.reshape(1, length, groups, n),
                    seg_c.reshape(1, length, groups, n),
                    self.chunk_size,
                    D=self.D,
                    dt_bias=self.dt_bias,
                    dt_softplus=True,
                    dt_limit=self.dt_limit,
                    initial_state=ssm_state,
                )
                ys.append(scan.y.reshape(length, heads * head_dim))
                conv_state, ssm_state = conv.final_state, scan.final_state
                for capture in captures:
                    if capture.offset == cut:
                        conv_pool[capture.slot] = conv_state[0]
                        ssm_pool[capture.slot] = ssm_state[0]
                seg_start = cut
            assert conv_state is not None and ssm_state is not None  # new_len >= 1 makes one segment
            conv_pool.index_copy_(0, slot, conv_state.to(conv_pool.dtype))
            ssm_pool.index_copy_(0, slot, ssm_state.to(ssm_pool.dtype))
            start += new_len
        return ys[0] if len(ys) == 1 else torch.cat(ys)

    def _decode(
        self, xbc: torch.Tensor, dt: torch.Tensor, batch: ForwardBatch, state: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        conv_pool, ssm_pool = state["conv"], state["ssm"]
        slots = batch.state_slots
        batch_size = xbc.shape[0]
        # Both kernels update the state they are given in place: the pool rows themselves when
        # the slots are consecutive (always for one sequence), else gathered copies written back.
        conv_state = consecutive_rows(conv_pool, slots)
        ssm_state = consecutive_rows(ssm_pool, slots)
        gathered = conv_state is None or ssm_state is None
        if gathered:
            conv_state = conv_pool.index_select(0, slots)
            ssm_state = ssm_pool.index_select(0, slots)
        xbc = causal_conv1d_update(xbc, conv_state, self.conv1d.weight.squeeze(1), self.conv1d.bias, "silu")
        x, b, c = self._split_xbc(xbc)
        y = selective_state_update(
            ssm_state,
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
        )
        if gathered:
            conv_pool.index_copy_(0, slots, conv_state)
            ssm_pool.index_copy_(0, slots, ssm_state)
        return y.reshape(batch_size, self.intermediate_size)
