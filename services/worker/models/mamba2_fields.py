"""The `mamba_*` config.json fields of the families whose recurrent layers are transformers' standard
Mamba2 mixer under those names (Bamba, Granite-4.0-H, Falcon-H1), parsed once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from himamba.services.worker.layers.mamba2 import Mamba2Mixer
from himamba.services.worker.models.hf_config import ConfigFields


def mamba_head_dim(f: ConfigFields, width: int, heads: int) -> int:
    """`mamba_d_head` ("auto" or absent: width / heads), checked against the mamba width."""
    d_head = f.get("mamba_d_head")
    if d_head is None or d_head == "auto":
        d_head = width // heads
    elif isinstance(d_head, bool) or not isinstance(d_head, int):
        raise ValueError(f"{f.family} config.json: field 'mamba_d_head' must be an integer or 'auto', got {d_head!r}")
    if d_head * heads != width:
        raise ValueError(
            f"{f.family} config.json: field 'mamba_d_head' ({d_head}) times mamba_n_heads ({heads}) must equal "
            f"the mamba width ({width})"
        )
    return d_head


@dataclass(frozen=True)
class Mamba2Fields:
    """The Mamba2 mixer's hyper-parameters (transformers' defaults where a field is absent)."""

    width: int  # the mixer's inner width: n_heads * d_head
    n_heads: int
    d_head: int
    d_state: int
    n_groups: int
    d_conv: int
    chunk_size: int
    conv_bias: bool
    proj_bias: bool
    time_step_limit: tuple[float, float]

    @classmethod
    def parse(cls, f: ConfigFields, width: int) -> Mamba2Fields:
        """Parse the fields of a mixer `width` wide (the family decides how config.json sets it)."""
        heads = f.int("mamba_n_heads", default=128)
        return cls(
            width=width,
            n_heads=heads,
            d_head=mamba_head_dim(f, width, heads),
            d_state=f.int("mamba_d_state", default=256),
            n_groups=f.int("mamba_n_groups", default=1),
            d_conv=f.int("mamba_d_conv", default=4),
            chunk_size=f.int("mamba_chunk_size", default=256),
            conv_bias=f.bool("mamba_conv_bias", default=True),
            proj_bias=f.bool("mamba_proj_bias", default=False),
            time_step_limit=f.float_pair("time_step_limit", default=(0.0, float("inf"))),
        )

    def mixer(
        self, hidden_size: int, norm_eps: float, activation: str, device: torch.device, dtype: torch.dtype
    ) -> Mamba2Mixer:
        """The standard Mamba2 mixer (grouped gated norm, dt clamped to `time_step_limit` in prefill)."""
        return Mamba2Mixer(
            hidden_size=hidden_size,
            num_heads=self.n_heads,
            head_dim=self.d_head,
            state_size=self.d_state,
            n_groups=self.n_groups,
            conv_kernel=self.d_conv,
            chunk_size=self.chunk_size,
            norm_eps=norm_eps,
            device=device,
            dtype=dtype,
            dt_limit=self.time_step_limit,
            conv_bias=self.conv_bias,
            proj_bias=self.proj_bias,
            activation=activation,
        )
