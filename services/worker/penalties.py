"""Repetition, frequency and presence penalties, kept per sequence and updated per step.

The worker feeds each sequence's tokens in as it computes them, so applying the penalties costs
O(vocabulary) per step whatever the context length, and the scheduler never resends a history.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from himamba.common.types import SamplingParams


class PenaltyState:
    """The context seen so far by one sequence: which tokens occur at all (repetition penalty,
    HF: prompt and output) and how often each occurs in the output (OpenAI: frequency/presence)."""

    def __init__(self, vocab_size: int, num_prompt: int, device: torch.device) -> None:
        self.num_prompt = num_prompt
        self.length = 0  # context tokens fed so far
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.out_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)

    def feed(self, tokens: Sequence[int] | torch.Tensor) -> None:
        """The next context tokens, in order."""
        ids = torch.as_tensor(tokens, dtype=torch.int64, device=self.seen.device).view(-1)
        if ids.numel() == 0:
            return
        self.seen[ids] = True
        out_from = max(self.num_prompt - self.length, 0)  # index into ids where the output starts
        if out_from < ids.numel():
            out = ids[out_from:]
            self.out_counts.index_add_(0, out, torch.ones(out.numel(), device=self.out_counts.device))
        self.length += ids.numel()

    def apply(self, row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        """Penalised copy of one row of float32 logits."""
        if p.repetition_penalty != 1.0:
            scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row = torch.where(self.seen, scaled, row)
        if p.frequency_penalty or p.presence_penalty:
            c = self.out_counts
            row = row - p.frequency_penalty * c - p.presence_penalty * (c > 0).float()
        return row
