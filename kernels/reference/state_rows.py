"""Moving recurrent states between the state pool and a batch: gather rows out, scatter rows back.

A pool tensor is [slots, *row] (one row per state slot); a batch's states are [B, *row] at slots [B].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

T = TypeVar("T")


def _check_slots(pool: Tensor, slots: Tensor) -> None:
    if slots.dim() != 1 or slots.dtype != torch.int64:
        raise ValueError(f"slots must be a 1-d int64 tensor, got {slots.dtype} {tuple(slots.shape)}")
    if pool.dim() < 1:
        raise ValueError("pool must have a leading slot dim")


def gather_state_rows(pool: Tensor, slots: Tensor) -> Tensor:
    """Copies of `pool`'s rows at `slots` [B]: a new [B, *row] tensor in the pool's dtype."""
    _check_slots(pool, slots)
    return pool.index_select(0, slots)


def scatter_state_rows(pool: Tensor, slots: Tensor, rows: Tensor) -> None:
    """Store rows [B, *row] at `pool[slots]` in place, cast to the pool's dtype (rows may be expanded views)."""
    _check_slots(pool, slots)
    if tuple(rows.shape) != (slots.shape[0], *pool.shape[1:]):
        raise ValueError(f"rows must be {[slots.shape[0], *pool.shape[1:]]}, got {tuple(rows.shape)}")
    pool.index_copy_(0, slots, rows.to(pool.dtype))


def check_state_indices(pool: Tensor, batch: int, indices: Tensor) -> Tensor:
    """Raise ValueError unless `indices` is a [batch] int32/int64 slot per batch row of `pool`
    [slots, *row] (the values are not read: that would be a device sync); return a [batch, *row]
    stand-in for the batch's rows (an expanded view of row 0, no copy) for the ops' shape checks."""
    if indices.dim() != 1 or indices.shape[0] != batch or indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"state_batch_indices must be a [{batch}] int32/int64 tensor, got {indices.dtype} {tuple(indices.shape)}"
        )
    if pool.dim() < 1 or pool.shape[0] < 1:
        raise ValueError(f"a state pool indexed by state_batch_indices needs a slot dim, got {tuple(pool.shape)}")
    return pool[:1].expand(batch, *pool.shape[1:])


def update_rows_at(pool: Tensor, indices: Tensor, update: Callable[[Tensor], T]) -> T:
    """`update(rows)` on `pool`'s rows at `indices`, which it mutates in place, written back to the pool.

    The reference semantics of an op's `state_batch_indices`: the twins read and write the pool rows
    themselves, with no copy."""
    indices = indices.long()
    rows = pool.index_select(0, indices)
    result = update(rows)
    pool.index_copy_(0, indices, rows)
    return result
