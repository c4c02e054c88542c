"""The activation after a recurrent layer's depthwise conv, as the config names it.

transformers applies `ACT2FN[hidden_act]` (Mamba2, Mamba1, gated DeltaNet) to the conv output. Our conv
kernels fuse SiLU only; any other activation runs as its own op on the kernel's plain output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from himamba.services.worker.layers.activation import activation_fn


class ConvActivation(NamedTuple):
    """`fused`: the name the conv kernel applies itself ("silu" or None); `after`: what runs on its
    output when the kernel cannot (None when fused)."""

    fused: str | None
    after: Callable[[torch.Tensor], torch.Tensor] | None

    def apply(self, out: torch.Tensor) -> torch.Tensor:
        """The conv kernel's output with the unfused part of the activation applied."""
        return out if self.after is None else self.after(out)


def conv_activation(name: str) -> ConvActivation:
    """The ConvActivation of an HF activation name (raises ValueError naming an unknown one)."""
    if name in ("silu", "swish"):
        return ConvActivation("silu", None)
    return ConvActivation(None, activation_fn(name))
