"""Reading a family's rotary settings from config.json (`rope_parameters`, or the older spellings), and
the frequencies each supported rope type gives (transformers' `ROPE_INIT_FUNCTIONS`, reproduced).

Supported rope types: "default", "linear", "llama3", "yarn" — the ones whose frequencies are fixed at
load. "dynamic" and "longrope" change the frequencies with the batch's longest sequence in
transformers, which a paged server cannot reproduce per sequence; they are refused by name.
"""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import NamedTuple

import torch

from himamba.services.worker.layers.partial_rotary import PartialRotaryEmbedding
from himamba.services.worker.models.hf_config import ConfigFields

# rope type -> (required keys, optional keys) of `rope_parameters` beyond rope_theta.
_TYPE_KEYS = MappingProxyType(
    {
        "default": ((), ()),
        "linear": (("factor",), ()),
        "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
        "yarn": (
            ("factor",),
            ("attention_factor", "mscale", "mscale_all_dim", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "truncate"),
        ),
    }
)  # fmt: skip


class RopeSettings(NamedTuple):
    """A family's rope: base frequency, the fraction of each head's channels it rotates, the rope type
    and that type's parameters (sorted `rope_parameters` items)."""

    theta: float
    partial_rotary_factor: float
    rope_type: str = "default"
    params: tuple[tuple[str, float | bool], ...] = ()
    max_position_embeddings: int = 2048

    def frequencies(self, rotary_dim: int) -> tuple[torch.Tensor, float]:
        """(inv_freq [rotary_dim / 2] float32 on the CPU, the factor cos and sin are multiplied by)."""
        base, dim, p = self.theta, rotary_dim, dict(self.params)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if self.rope_type == "default":
            return inv_freq, 1.0
        if self.rope_type == "linear":
            return inv_freq / p["factor"], 1.0
        if self.rope_type == "llama3":
            return _llama3(inv_freq, p), 1.0
        return _yarn(base, dim, p, self.max_position_embeddings)

    def rotary(self, head_dim: int, device: torch.device) -> PartialRotaryEmbedding:
        """The rotary module for heads of `head_dim` channels."""
        rotary_dim = int(head_dim * self.partial_rotary_factor)
        if rotary_dim < 2 or rotary_dim % 2 != 0:
            raise ValueError(
                f"partial_rotary_factor {self.partial_rotary_factor} of head_dim {head_dim} must give an even "
                f"rotary width >= 2, got {rotary_dim}"
            )
        inv_freq, scaling = self.frequencies(rotary_dim)
        return PartialRotaryEmbedding(head_dim, rotary_dim, self.theta, device, inv_freq, scaling)


def _llama3(inv_freq: torch.Tensor, p: dict[str, float | bool]) -> torch.Tensor:
    factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_context = float(p["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(base: float, dim: int, p: dict[str, float | bool], max_positions: int) -> tuple[torch.Tensor, float]:
    original = float(p.get("original_max_position_embeddings", max_positions))
    factor = float(p["factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = mscale(factor, float(m)) / mscale(factor, float(m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def _number(f: ConfigFields, name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{f.family} config.json: field {name!r} must be a number, got {value!r}")
    return float(value)


def rope_settings(
    f: ConfigFields, default_theta: float, default_partial: float = 1.0, reads_partial: bool = True
) -> RopeSettings:
    """`rope_parameters` (transformers 5) or `rope_scaling` + top-level `rope_theta` /
    `partial_rotary_factor` (older files). `reads_partial` False: the family's transformers rope rotates
    the whole head whatever `partial_rotary_factor` says (FalconH1, Granite, LFM2, Zamba2)."""
    params = f.get("rope_parameters", "rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"{f.family} config.json: field 'rope_parameters' must be an object, got {params!r}")
    params = params or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _TYPE_KEYS:
        raise ValueError(
            f"{f.family} config.json: rope_type {rope_type!r} is not supported (supported: {', '.join(_TYPE_KEYS)})"
        )
    required, optional = _TYPE_KEYS[rope_type]
    missing = [k for k in required if params.get(k) is None]
    if missing:
        raise ValueError(f"{f.family} config.json: rope_type {rope_type!r} needs rope_parameters {missing}")
    typed: list[tuple[str, float | bool]] = []
    for key in (*required, *optional):
        value = params.get(key)
        if value is None:
            continue
        typed.append((key, value if key == "truncate" and isinstance(value, bool) else _number(f, key, value)))
    theta = params.get("rope_theta", f.get("rope_theta"))
    partial = params.get("partial_rotary_factor", f.get("partial_rotary_factor")) if reads_partial else None
    return RopeSettings(
        default_theta if theta is None else _number(f, "rope_theta", theta),
        default_partial if partial is None else _number(f, "partial_rotary_factor", partial),
        rope_type,
        tuple(sorted(typed)),
        f.int("max_position_embeddings", default=2048),
    )
