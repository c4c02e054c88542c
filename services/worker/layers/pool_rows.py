"""Rows of a pool tensor as an in-place view, when a batch's slots allow one."""

from __future__ import annotations

import torch

from himamba.kernels import gather_state_rows


def consecutive_rows(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor | None:
    """`pool[slots]` as a view (`pool.narrow`) when `slots` are consecutive ascending, else None.

    A decode step can then update states in the pool itself instead of gathering them into a
    copy and scattering them back (for one sequence, always). Only CPU slots are inspected:
    reading device slots on the host would cost a synchronisation per layer.
    """
    if slots.device.type != "cpu" or slots.dim() != 1 or slots.numel() == 0:
        return None
    first = int(slots[0])
    count = slots.numel()
    if count > 1 and not torch.equal(slots, torch.arange(first, first + count, dtype=slots.dtype)):
        return None
    return pool.narrow(0, first, count)


def rows_to_update(pool: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The rows a decode kernel updates in place: a view of the pool when `slots` allow one, else
    a gathered copy (second value True: the caller writes it back with `scatter_state_rows`)."""
    rows = consecutive_rows(pool, slots)
    if rows is not None:
        return rows, False
    return gather_state_rows(pool, slots), True
