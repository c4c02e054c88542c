"""OpenAI's `logit_bias` on device: static per-row buffers of token ids and values, scattered
onto a batch's logits in one kernel.

Each sequence biases at most MAX_LOGIT_BIAS tokens, so a batch's biases fit two fixed-shape
[rows, MAX_LOGIT_BIAS] buffers (int64 ids, float32 values) allocated once: a step copies its rows'
entries in (unused entries are token 0 with value 0.0, which adds nothing) and adds them with
`scatter_add_` over the first B rows. No shape depends on the data, and the buffers keep their
addresses, so the add can be replayed inside a captured CUDA graph as it runs eagerly here (the
sampler runs after the decode graph: decode_graphs.py). A batch in which no sequence has a bias
touches nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from himamba.common.types import MAX_LOGIT_BIAS, SamplingParams


class BiasRows(NamedTuple):
    """A batch's biases: rows [0, B) of the static buffers."""

    ids: torch.Tensor  # [B, MAX_LOGIT_BIAS] int64
    values: torch.Tensor  # [B, MAX_LOGIT_BIAS] float32

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of float32 logits [B, V] with the biases added (the raw logits stay the
        logprobs' and return_logits' own)."""
        return logits.scatter_add(1, self.ids, self.values)


class LogitBias:
    """The worker's static bias buffers, `rows` sequences wide (the most a batch samples)."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.device = device
        self._alloc(rows)

    def _alloc(self, rows: int) -> None:
        self.ids = torch.zeros(rows, MAX_LOGIT_BIAS, dtype=torch.int64, device=self.device)
        self.values = torch.zeros(rows, MAX_LOGIT_BIAS, dtype=torch.float32, device=self.device)

    def load(self, params: Sequence[SamplingParams]) -> BiasRows | None:
        """The biases of a batch whose rows sample with `params` (None: no row has one)."""
        if not any(p.logit_bias for p in params):
            return None
        b = len(params)
        if b > self.ids.shape[0]:  # a batch larger than the configured maximum: grow once
            self._alloc(b)
        ids = torch.zeros(b, MAX_LOGIT_BIAS, dtype=torch.int64)
        values = torch.zeros(b, MAX_LOGIT_BIAS, dtype=torch.float32)
        for i, p in enumerate(params):
            if p.logit_bias:
                n = len(p.logit_bias)
                ids[i, :n] = torch.tensor(list(p.logit_bias.keys()), dtype=torch.int64)
                values[i, :n] = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32)
        # From pageable host memory: the copy is staged before it returns, so the host tensors may go.
        self.ids[:b].copy_(ids, non_blocking=True)
        self.values[:b].copy_(values, non_blocking=True)
        return BiasRows(self.ids[:b], self.values[:b])
