"""Mamba track-buffer strategies: how decode-time recurrent states reach the prefix cache.

A state is reusable only at a page-aligned prefix length, so while a request decodes, its
working state is copied aside ("tracked") whenever its context reaches a multiple of
`mamba_track_interval`, and the newest tracked state is inserted into the tree when the
request finishes, with the KV up to that boundary.

- `no_buffer`: no track slots. Prompt prefixes (and the state at the prompt's last whole page,
  captured during the prefill) are cached; decoded text is not.
- `extra_buffer`: two track slots per request (ping-pong). A boundary step writes the slot that
  does not hold the newest tracked state, then that slot becomes the newest.
- `extra_buffer_lazy`: one track slot per request, holding the newest tracked state; a boundary
  step gets a second slot on demand (the cache controller evicts a cached state if the pool is
  empty), writes it, and the older slot goes back to the pool. If no slot can be had, the step
  tracks nothing: the older tracked state stays valid (it is inserted at the finish) and the next
  boundary tries again.
- `single_buffer`: one track slot, overwritten in place at each boundary.

Why `single_buffer` is safe here: a decode step sent while step N runs (decode_ahead.py) is never
a boundary step when N is one (a step is built ahead only when boundaries are at least 2 tokens
apart), so it never overwrites the state N tracks; a request is in no step sent after the one
that ended it (the worker leaves it out), and a tracked state goes to the tree only at the
release, when the request is in no batch. So the ping-pong sglang's overlap scheduler needs (a
tracked state overwritten while the tree may still take it) protects nothing in himamba.

State slots a running request holds at steady decode (working + track): no_buffer 1,
extra_buffer 3, extra_buffer_lazy 2 (3 during a boundary step), single_buffer 2. States the
request donated to the tree (prompt checkpoints) are not locked by it: the tree may evict them.
"""

from __future__ import annotations

from typing import Literal

from himamba.common.types import STATE_SLOTS_PER_SAMPLE
from himamba.services.scheduler.request import Req

Strategy = Literal["no_buffer", "extra_buffer", "extra_buffer_lazy", "single_buffer"]


def track_slots_at_admission(strategy: Strategy) -> int:
    """Track slots a request holds from admission on (besides its working slot)."""
    return STATE_SLOTS_PER_SAMPLE[strategy] - 1


def is_boundary(context_len_after: int, interval: int) -> bool:
    return context_len_after > 0 and context_len_after % interval == 0


def _spare(req: Req) -> list[int]:
    """Track slots not holding the newest tracked state."""
    return [s for s in req.track_slots if s != req.newest_track_slot]


def needs_boundary_slot(req: Req, strategy: Strategy) -> bool:
    """Lazy only: the boundary step needs a slot to write into that does not hold the newest
    tracked state, and the request has none."""
    return strategy == "extra_buffer_lazy" and not _spare(req)


def decode_capture_slot(req: Req, strategy: Strategy) -> int | None:
    """The slot a boundary decode step writes its state into, or None (no tracking now)."""
    if strategy == "no_buffer" or not req.track_slots:
        return None
    if strategy == "extra_buffer":
        return req.track_slots[req.next_track % len(req.track_slots)]
    if strategy == "single_buffer":
        return req.track_slots[0]
    spare = _spare(req)  # lazy: the slot allocated for this boundary
    return spare[0] if spare else None


def after_boundary(req: Req, strategy: Strategy, written: int, boundary_len: int) -> list[int]:
    """Bookkeeping once the boundary step's forward completed. Returns slots to free."""
    req.newest_track_slot = written
    req.last_track_len = boundary_len
    if strategy == "extra_buffer":
        req.next_track = (req.next_track + 1) % max(len(req.track_slots), 1)
        return []
    if strategy != "extra_buffer_lazy":
        return []
    # lazy: keep the slot just written, give back the older one
    old = [s for s in req.track_slots if s != written]
    req.track_slots = [written]
    return old
