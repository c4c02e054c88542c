"""Where a step checkpoints recurrent states for the tree, and what the tree gets once the step
that wrote them has completed.

Three kinds of capture (each a (kind, context position, slot)):
- `admit`: planned by the cache controller at admission (branch point, last whole page of the
  prompt, last page boundary before its final token), into slots it gave the request;
- `chunk`: the end of a non-final, page-aligned prefill chunk, into a spare track slot, so that
  concurrent requests with the same long prefix hit it before this prefill is over;
- `track`: a decode step that reaches a `mamba_track_interval` boundary (mamba_track.py).
The tree inserts a state only after the forward that wrote it has completed (`commit`).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from himamba.common.messages import AllocSlots, CacheOp, FreeSlots, Insert
from himamba.services.scheduler import mamba_track
from himamba.services.scheduler.request import Req

Kind = Literal["admit", "chunk", "track"]


class Capture(NamedTuple):
    kind: Kind
    pos: int  # context position the state is taken at
    slot: int


def captures_for(
    req: Req, mode: str, n: int, strategy: mamba_track.Strategy, interval: int, page_size: int, start: int = -1
) -> list[Capture]:
    """Every state this step (`n` new tokens of `req`, from `start`, by default its computed
    length) must capture. Reads the request, changes nothing."""
    if start < 0:
        start = req.computed_len
    if mode == "decode" and not req.pending_captures and (start + 1) % interval:
        return []  # the common decode step: nothing to capture
    caps = [Capture("admit", pos, slot) for pos, slot in req.pending_captures if start < pos <= start + n]
    if mode == "decode":
        if mamba_track.is_boundary(start + 1, interval):
            slot = mamba_track.decode_capture_slot(req, strategy)
            if slot is not None:
                caps.append(Capture("track", start + 1, slot))
    else:
        slot = _chunk_capture_slot(req, n, strategy, page_size)
        if slot is not None:
            caps.append(Capture("chunk", start + n, slot))
    return caps


def _chunk_capture_slot(req: Req, n: int, strategy: mamba_track.Strategy, page_size: int) -> int | None:
    """A track slot to checkpoint a non-final, page-aligned prefill chunk into (donated to the
    tree afterwards, and replaced by a fresh one)."""
    end = req.computed_len + n
    if strategy == "no_buffer" or end >= req.context_len or end % page_size or end <= req.last_state_len:
        return None
    if any(pos == end for pos, _ in req.pending_captures):
        return None
    free = [s for s in req.track_slots if s != req.newest_track_slot]
    return free[0] if free else None


def commit(req: Req, captures: list[Capture], strategy: mamba_track.Strategy) -> list[CacheOp]:
    """The forward that wrote these states has completed: the ops that give them to the tree."""
    ops: list[CacheOp] = []
    for kind, pos, slot in captures:
        if kind == "admit":
            req.pending_captures.remove((pos, slot))
            req.slots.remove(slot)
            ops.append(Insert(rid=req.rid, tokens=req.tokens(0, pos), slot=slot))
            req.last_state_len = max(req.last_state_len, pos)
        elif kind == "chunk":
            # Donate the track slot to the tree and ask for a fresh one in its place.
            req.track_slots.remove(slot)
            req.slots.remove(slot)
            req.next_track = 0
            ops.append(Insert(rid=req.rid, tokens=req.tokens(0, pos), slot=slot))
            ops.append(AllocSlots(rid=req.rid, num=1))
            req.last_state_len = max(req.last_state_len, pos)
        else:
            freed = mamba_track.after_boundary(req, strategy, slot, pos)
            for s in freed:
                req.slots.remove(s)
            if freed:
                ops.append(FreeSlots(rid=req.rid, slots=freed))
    return ops
