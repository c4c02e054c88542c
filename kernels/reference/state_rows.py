"""Moving recurrent states between the state pool and a batch: gather rows out, scatter rows back.

A pool tensor is [slots, *row] (one row per state slot); a batch's states are [B, *row] at slots [B].
"""

from __future__ import annotations

import torch
from torch import Tensor


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
