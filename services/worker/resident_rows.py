"""A decode batch's recurrent-state rows, kept out of the pool while the batch stays the same.

A decode step reads and writes every recurrent layer's state rows of its sequences. Their pool
slots are scattered (a long-running server's free lists), so each layer gathered its rows into a
copy and scattered them back, every step: on a CPU at batch 32 that was over a quarter of the
step. At steady decode the next step has the same slots in the same order, so the rows stay
gathered ("resident") from one step to the next and are written back only when something else is
about to read or write the pool: a different batch, a prefill, a state copy or reset, a copy to or
from the host, a look at the pool from outside (`StatePool.tensors`).

Only on the CPU path: on a GPU, reading the slots on the host to compare batches would cost a
synchronisation per step, and the kernels update the pool rows in place by slot index anyway.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from himamba.kernels.dispatch import cuda_path

if TYPE_CHECKING:
    from himamba.services.worker.forward_batch import ForwardBatch


class ResidentRows:
    """The rows of one decode batch's slots, per recurrent layer (gathered on first use)."""

    def __init__(self, pool: list[dict[str, torch.Tensor]], batch: ForwardBatch, key: list[int]) -> None:
        assert batch.state_slots is not None
        self.pool = pool
        self.key = key
        self.slots = batch.state_slots.clone()
        self.rows: list[dict[str, torch.Tensor] | None] = [None] * len(pool)
        self.batch: ForwardBatch | None = None
        self.view: ForwardBatch | None = None
        self.use(batch)

    def use(self, batch: ForwardBatch) -> None:
        """`batch` (same slots, same order) is the step now running."""
        self.batch = batch
        # The layers see the resident rows as a pool of exactly the batch: slots 0..B-1, which
        # they update in place (a pool whose rows are consecutive needs no gather).
        arange = torch.arange(len(self.key), dtype=torch.int64)
        self.view = dataclasses.replace(batch, state_slots=arange)

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        rows = self.rows[index]
        if rows is None:
            rows = self.rows[index] = {name: t.index_select(0, self.slots) for name, t in self.pool[index].items()}
        return rows

    def write_back(self) -> None:
        for index, rows in enumerate(self.rows):
            if rows is not None:
                for name, t in self.pool[index].items():
                    t.index_copy_(0, self.slots, rows[name])
        self.rows = [None] * len(self.pool)


def is_resident_batch(batch: ForwardBatch) -> bool:
    """A batch whose rows may stay resident: a decode step over CPU slots."""
    slots = batch.state_slots
    return batch.mode == "decode" and slots is not None and not cuda_path(slots) and slots.numel() > 0
