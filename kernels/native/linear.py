"""Dense projections over a weight packed once into column panels (see linear.c): the decode step's
matrix-vector products at the rate weights stream from memory, and prefill's at the FMA rate.

`pack` reorders a [out, in] weight into panels of 16 output columns ([ceil(out/16), in, 16], the
columns past `out` zero); `linear` is `F.linear` over it. Each output is one multiply-add chain
over the input features in order, so a row's result does not depend on the batch it is in.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .build import native_build

PANEL = 16


class PanelWeight(NamedTuple):
    """A weight packed by `pack`: `panels` [ceil(out/16), in, 16] and the weight's `out_features`."""

    panels: Tensor
    out_features: int

    @property
    def in_features(self) -> int:
        return self.panels.shape[1]


def supports(weight: Tensor) -> bool:
    """Whether `pack` takes this weight: a float32 CPU matrix."""
    return weight.device.type == "cpu" and weight.dim() == 2 and weight.dtype == torch.float32


def pack(weight: Tensor) -> PanelWeight:
    """`weight` [out, in] reordered into panels (a copy; later changes to `weight` do not reach it)."""
    if not supports(weight):
        raise ValueError(
            f"pack takes a float32 CPU matrix, got {weight.dtype} {tuple(weight.shape)} on {weight.device}"
        )
    out_features, in_features = weight.shape
    n_panels = -(-out_features // PANEL)
    padded = torch.zeros(n_panels * PANEL, in_features, dtype=weight.dtype)
    padded[:out_features] = weight.detach()
    panels = padded.view(n_panels, PANEL, in_features).transpose(1, 2).contiguous()
    return PanelWeight(panels, out_features)


def linear(x: Tensor, weight: PanelWeight, bias: Tensor | None) -> Tensor:
    """x [..., in] @ W.T (+ bias) for a float32 CPU x, W packed by `pack`."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"linear takes float32 CPU input, got {x.dtype} on {x.device}")
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {weight.in_features}")
    if bias is not None and (bias.shape != (weight.out_features,) or bias.dtype != torch.float32):
        raise ValueError(f"bias must be float32 [{weight.out_features}], got {bias.dtype} {tuple(bias.shape)}")
    library = native_build().library
    assert library is not None
    rows = x.reshape(x.shape[:-1].numel(), x.shape[-1])
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]):
        rows = rows.contiguous()
    bias = None if bias is None else bias.contiguous()  # kept alive across the call
    out = torch.empty(rows.shape[0], weight.out_features, dtype=x.dtype)
    if rows.shape[0] > 0 and rows.shape[1] > 0:
        library.hm_linear_f32(
            rows.data_ptr(), rows.stride(0), weight.panels.data_ptr(),
            None if bias is None else bias.data_ptr(), out.data_ptr(),
            rows.shape[0], weight.out_features, rows.shape[1],
        )  # fmt: skip
    elif rows.shape[0] > 0:  # no input features: the sums are empty
        out.zero_()
        if bias is not None:
            out += bias
    return out.view(*x.shape[:-1], weight.out_features)
