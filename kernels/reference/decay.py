"""Pairwise decay factors inside a chunk, shared by the chunked scans (Mamba2 SSD, gated delta rule).

Given per-token log decays a_1..a_Q (each <= 0), the decay from position s to position l is

    decay[l, s] = exp(a_{s+1} + ... + a_l)   for l >= s (1 on the diagonal),   0 for l < s.
"""

from __future__ import annotations

import torch
from torch import Tensor


def segment_decay(log_decay: Tensor) -> Tensor:
    """[..., Q] log decays -> [..., Q(l), Q(s)] decay factors, lower triangular with a unit diagonal.

    Summing the masked increments (rather than subtracting two cumulative sums) keeps the
    exponent exact when the cumulative decay of a long chunk is large.
    """
    q = log_decay.shape[-1]
    pos = torch.arange(q, device=log_decay.device)
    lower = pos[:, None] >= pos[None, :]
    strictly_lower = pos[:, None] > pos[None, :]
    seg = log_decay.unsqueeze(-1).expand(*log_decay.shape, q).masked_fill(~strictly_lower, 0.0).cumsum(-2)
    return seg.exp().masked_fill(~lower, 0.0)
