"""Mamba track-buffer strategies: how decode-time recurrent states reach the prefix cache.

A state is reusable only at a page-aligned prefix length, so while a request decodes, its
working state is copied aside ("tracked") whenever its context reaches a multiple of
`mamba_track_interval`, and the newest tracked state is inserted into the tree when the
request finishes, with the KV up to that boundary.

- `no_buffer`: no track slots. Prompt prefixes (and the state at the prompt's last whole page,
  captured during the prefill) are cached; decoded text is not.
- `extra_buffer`: two track slots per request (ping-pong). A boundary step writes the slot that
  does not hold the newest tracked state, then that slot becomes the newest.
- `extra_buffer_lazy`: one track slot per request; a boundary step allocates the second slot on
  demand (the cache controller evicts a state if the pool is empty), and once the copy has
  landed the older slot goes back to the pool. If no slot can be had, the request is marked
  not-insert: at finish its KV is released instead of inserted. It carries on regardless.

Resident track memory: extra_buffer holds 3 slots per running request (working + 2), lazy
holds 2 (+1 for the duration of a boundary step).
"""

from __future__ import annotations

from typing import Literal

from himamba.services.scheduler.request import Req

Strategy = Literal["no_buffer", "extra_buffer", "extra_buffer_lazy"]


def track_slots_at_admission(strategy: Strategy) -> int:
    """Track slots a request holds from admission on (besides its working slot)."""
    return {"no_buffer": 0, "extra_buffer": 2, "extra_buffer_lazy": 1}[strategy]


def is_boundary(context_len_after: int, interval: int) -> bool:
    return context_len_after > 0 and context_len_after % interval == 0


def decode_capture_slot(req: Req, strategy: Strategy) -> int | None:
    """The slot a boundary decode step writes its state into, or None (no tracking now).

    For the lazy strategy the second slot must already be in `req.track_slots` (allocated by
    the scheduler before the step); if it could not be had, the step tracks nothing.
    """
    if strategy == "no_buffer" or not req.track_slots:
        return None
    if strategy == "extra_buffer":
        return req.track_slots[req.next_track % len(req.track_slots)]
    # lazy: the newest state (if any) is in track_slots[0]; the fresh slot is the other one
    if len(req.track_slots) < 2:
        return None
    return req.track_slots[1]


def after_boundary(req: Req, strategy: Strategy, written: int, boundary_len: int) -> list[int]:
    """Bookkeeping once the boundary step's forward completed. Returns slots to free."""
    req.newest_track_slot = written
    req.last_track_len = boundary_len
    if strategy == "extra_buffer":
        req.next_track = (req.next_track + 1) % max(len(req.track_slots), 1)
        return []
    # lazy: keep the slot just written, give back the older one
    old = req.track_slots[0]
    req.track_slots = [written]
    return [old]
