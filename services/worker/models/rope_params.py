"""Reading a family's rotary settings from config.json (`rope_parameters`, or the older spellings)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from himamba.services.worker.layers.partial_rotary import PartialRotaryEmbedding
from himamba.services.worker.models.hf_config import ConfigFields


class RopeSettings(NamedTuple):
    """The default rope: base frequency and the fraction of each head's channels it rotates."""

    theta: float
    partial_rotary_factor: float

    def rotary(self, head_dim: int, device: torch.device) -> PartialRotaryEmbedding:
        """The rotary module for heads of `head_dim` channels."""
        rotary_dim = int(head_dim * self.partial_rotary_factor)
        if rotary_dim < 2 or rotary_dim % 2 != 0:
            raise ValueError(
                f"partial_rotary_factor {self.partial_rotary_factor} of head_dim {head_dim} must give an even "
                f"rotary width >= 2, got {rotary_dim}"
            )
        return PartialRotaryEmbedding(head_dim, rotary_dim, self.theta, device)


def _number(f: ConfigFields, name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{f.family} config.json: field {name!r} must be a number, got {value!r}")
    return float(value)


def rope_settings(f: ConfigFields, default_theta: float, default_partial: float = 1.0) -> RopeSettings:
    """`rope_parameters` (transformers 5) or `rope_scaling` + top-level `rope_theta` /
    `partial_rotary_factor` (older files); only rope_type "default" is supported."""
    params = f.get("rope_parameters", "rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"{f.family} config.json: field 'rope_parameters' must be an object, got {params!r}")
    params = params or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"{f.family} config.json: rope_type {rope_type!r} is not supported (only 'default')")
    theta = params.get("rope_theta", f.get("rope_theta"))
    partial = params.get("partial_rotary_factor", f.get("partial_rotary_factor"))
    return RopeSettings(
        default_theta if theta is None else _number(f, "rope_theta", theta),
        default_partial if partial is None else _number(f, "partial_rotary_factor", partial),
    )
