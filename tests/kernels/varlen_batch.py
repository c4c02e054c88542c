"""The packed batch the native varlen kernel tests build: one `Varlen` for a list of
(new tokens, prefix, capture offsets), its sequences' slots scattered over a pool of `SLOTS`, and a
distinct slot for every capture, so a test can tell each slot's writer from its neighbours'."""

from __future__ import annotations

import torch

from himamba.kernels.varlen import Varlen, make_varlen

SLOTS = 40

Batch = list[tuple[int, int, list[int]]]


def layout(batch: Batch) -> tuple[Varlen, torch.Tensor]:
    """The batch's layout and its sequences' state slots ([B] int64), drawn without repeats."""
    free = iter(torch.randperm(SLOTS, generator=torch.Generator().manual_seed(1)).tolist())
    state_slots = torch.tensor([next(free) for _ in batch])
    captures = [[(o, next(free)) for o in offs] for _, _, offs in batch]
    v = make_varlen([n for n, _, _ in batch], [p for _, p, _ in batch], captures, torch.device("cpu"))
    return v, state_slots


def named_slots(v: Varlen, state_slots: torch.Tensor) -> set[int]:
    """Every slot the batch may write: its sequences' and its captures'."""
    return set(state_slots.tolist()) | {s for c in v.captures for _, s in c}
