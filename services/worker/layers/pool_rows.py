"""The state a decode kernel updates in place: the pool itself with the batch's slots, or its rows."""

from __future__ import annotations

from typing import NamedTuple

import torch

from himamba.kernels import gather_state_rows, scatter_state_rows
from himamba.kernels.dispatch import cuda_path


class DecodeRows(NamedTuple):
    """What a decode kernel gets as its state: `state` with `indices`, its state_batch_indices (the
    whole pool and the batch's slots), or the batch's rows (`indices` None). `gathered`: `state` is a
    copy that `write_back` stores into the pool."""

    state: torch.Tensor
    indices: torch.Tensor | None
    gathered: bool


def consecutive_rows(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor | None:
    """`pool[slots]` as a view (`pool.narrow`) when `slots` are consecutive ascending, else None.

    A decode step can then update states in the pool itself instead of gathering them into a
    copy and scattering them back (for one sequence, always). Only CPU slots are inspected:
    reading device slots on the host would cost a synchronisation per layer.
    """
    if cuda_path(slots) or slots.dim() != 1 or slots.numel() == 0:
        return None
    first = int(slots[0])
    count = slots.numel()
    if count > 1 and not torch.equal(slots, torch.arange(first, first + count, dtype=slots.dtype)):
        return None
    return pool.narrow(0, first, count)


def decode_rows(pool: torch.Tensor, slots: torch.Tensor) -> DecodeRows:
    """The state a decode kernel updates in place for the batch at `slots`.

    On the CUDA path the pool and the slots themselves: the kernel reads and writes the pool rows
    (no copy, no host look at the slots). On CPU a view of the pool when the slots are consecutive
    (one sequence, or a batch's resident rows, see resident_rows.py), else a gathered copy: the
    native kernels take rows, and a CPU gather of a few rows is cheap."""
    if cuda_path(pool):
        return DecodeRows(pool, slots, False)
    rows = consecutive_rows(pool, slots)
    if rows is not None:
        return DecodeRows(rows, None, False)
    return DecodeRows(gather_state_rows(pool, slots), None, True)


def write_back(pool: torch.Tensor, slots: torch.Tensor, rows: DecodeRows) -> None:
    """Store a gathered copy's updated rows into the pool (nothing to do for the others)."""
    if rows.gathered:
        scatter_state_rows(pool, slots, rows.state)
