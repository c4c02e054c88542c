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


def penalise_rows(
    logits: torch.Tensor, states: Sequence[PenaltyState | None], params: Sequence[SamplingParams]
) -> torch.Tensor:
    """A copy of a batch's float32 logits [B, V] with each row that has a PenaltyState penalised
    as its `apply` would (bit for bit), in a few batched ops whatever the number of rows."""
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return logits
    ps = [params[i] for i in rows]
    kept = [s for s in states if s is not None]
    device = logits.device
    every_row = len(rows) == logits.shape[0]
    idx = None if every_row else host_values(rows, torch.int64, device)
    sub = logits if idx is None else logits.index_select(0, idx)
    if any(p.repetition_penalty != 1.0 for p in ps):
        # A row without one divides or multiplies by exactly 1.0: unchanged.
        rep = host_values([p.repetition_penalty for p in ps], torch.float32, device).view(-1, 1)
        scaled = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(torch.stack([s.seen for s in kept]), scaled, sub)
    if any(p.frequency_penalty or p.presence_penalty for p in ps):
        freq = host_values([p.frequency_penalty for p in ps], torch.float32, device).view(-1, 1)
        pres = host_values([p.presence_penalty for p in ps], torch.float32, device).view(-1, 1)
        c = torch.stack([s.out_counts for s in kept])
        sub = sub - freq * c - pres * (c > 0).float()
    return sub if idx is None else logits.index_copy(0, idx, sub)


def host_values(values: Sequence[float] | Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Per-row values known on the host as a tensor on `device`: an asynchronous copy, which does not
    wait for the device (a plain `torch.tensor(values, device=cuda)` would)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
