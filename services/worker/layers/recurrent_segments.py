"""How a recurrent layer walks a prefill batch: per sequence, in segments cut at its capture offsets.

Every recurrent layer kind (Mamba2, Mamba1, gated DeltaNet, short conv) keeps a state
per sequence in a slot of the state pool (one dict of named tensors per layer). A prefill runs each
sequence from its slot's state (or from zeros when it has no cached prefix), stops at every capture
offset to copy the state out, and finally writes the state back to the sequence's slot. The layer
only supplies `step`: run tokens [start, end) from a given state. Decode needs no segments: every
sequence advances by one token from its slot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from himamba.kernels import gather_state_rows, scatter_state_rows
from himamba.services.worker.forward_batch import ForwardBatch

# One sequence's state in a layer, by component name, each with a leading batch dim of 1.
State = dict[str, torch.Tensor]
# step(start, end, state or None for zeros) -> (outputs of tokens [start, end), state after `end`)
Step = Callable[[int, int, State | None], tuple[torch.Tensor, State]]


class Segment(NamedTuple):
    """Tokens [start, end) of the batch's T axis, all of sequence `seq`."""

    seq: int
    start: int
    end: int
    first: bool  # starts the sequence: its initial state is its slot's (prefix_len > 0) or zeros
    last: bool  # ends the sequence: its final state goes back to the sequence's slot
    capture_slots: tuple[int, ...]  # state slots that receive a copy of the state after `end`


def prefill_segments(batch: ForwardBatch) -> list[Segment]:
    """The segments of a prefill batch, in token order."""
    segments: list[Segment] = []
    start = 0
    for i, new_len in enumerate(batch.new_lens):
        captures = batch.captures[i] if batch.captures else []
        cuts = sorted({c.offset for c in captures} | {new_len})
        seg_start = 0
        for cut in cuts:
            slots = tuple(c.slot for c in captures if c.offset == cut)
            segments.append(Segment(i, start + seg_start, start + cut, seg_start == 0, cut == new_len, slots))
            seg_start = cut
        start += new_len
    return segments


def read_slots(pool: dict[str, torch.Tensor], slots: torch.Tensor) -> State:
    """Copies of every component of `pool` at `slots` (int64 [B]); each [B, *shape]."""
    return {name: gather_state_rows(t, slots) for name, t in pool.items()}


def write_slots(pool: dict[str, torch.Tensor], slots: torch.Tensor, state: State) -> None:
    """Store `state` (each component [B, *shape]) at `slots`, cast to the pool's dtypes."""
    for name, t in pool.items():
        scatter_state_rows(t, slots, state[name])


def run_prefill(batch: ForwardBatch, pool: dict[str, torch.Tensor], step: Step) -> torch.Tensor:
    """Run `step` over every segment of the batch; returns the concatenated outputs [T, ...].

    Reads each sequence's initial state from its slot (only when prefix_len > 0, so a fresh
    sequence never sees what its slot held), writes captures and final states to the pool.
    """
    assert batch.state_slots is not None  # check_batch guarantees it for models with recurrent layers
    outs: list[torch.Tensor] = []
    state: State | None = None
    for seg in prefill_segments(batch):
        if seg.first:
            slot = batch.state_slots[seg.seq : seg.seq + 1]
            state = read_slots(pool, slot) if batch.prefix_lens[seg.seq] > 0 else None
        out, state = step(seg.start, seg.end, state)
        outs.append(out)
        if seg.capture_slots:
            targets = torch.tensor(seg.capture_slots, dtype=torch.int64, device=batch.state_slots.device)
            write_slots(pool, targets, {n: s.expand(len(seg.capture_slots), *s.shape[1:]) for n, s in state.items()})
        if seg.last:
            write_slots(pool, batch.state_slots[seg.seq : seg.seq + 1], state)
    return outs[0] if len(outs) == 1 else torch.cat(outs)
