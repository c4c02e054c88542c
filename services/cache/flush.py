"""Flushing the cache (sglang's /flush_cache): an idle controller is replaced by an empty one.

Only an idle cache is flushed, as sglang does: no request holds pages or slots (running, or
reserved for a sibling sample), no device<->host copy awaits the worker, and the storage tier has
no backup or prefetch in flight. Then nothing outside the controller points into its pools, so a
new controller of the same sizes over the same storage I/O is exactly "every device and host
tier empty"; the storage tier (perhaps shared with other servers) keeps its entries.
"""

from __future__ import annotations

from typing import NamedTuple

from himamba.services.cache.controller import CacheController


class FlushRefusal(NamedTuple):
    """Why a flush cannot run now; `busy`: only copies or storage jobs in flight (it will pass soon)."""

    reason: str
    busy: bool


class Flushed(NamedTuple):
    """What a flush freed: cached (evictable) pages and states of each tier."""

    device_pages: int
    device_states: int
    host_pages: int
    host_states: int


def flush_refusal(ctrl: CacheController) -> FlushRefusal | None:
    """Why `ctrl` may not be flushed now (None: it may)."""
    if ctrl.requests or ctrl.reserved:
        n = len(ctrl.requests) + len(ctrl.reserved)
        return FlushRefusal(f"{n} request(s) hold cache memory; flush when the server is idle", busy=False)
    storage = ctrl.storage
    if ctrl.awaiting_prefetch or (storage is not None and storage.prefetches):
        return FlushRefusal("requests are waiting for their storage prefetch", busy=False)
    if ctrl.pending:
        return FlushRefusal(f"{len(ctrl.pending)} device<->host copies in flight", busy=True)
    if storage is not None and storage.busy:
        return FlushRefusal("storage backups in flight", busy=True)
    return None


def flushed(ctrl: CacheController) -> tuple[CacheController, Flushed]:
    """An empty controller in `ctrl`'s place (same pools, same storage I/O and counters), and what
    `ctrl` held. The caller checked `flush_refusal(ctrl) is None`."""
    assert flush_refusal(ctrl) is None, "flushing a cache that is in use"
    u = ctrl.tree.usage() if ctrl.tree is not None else None
    freed = Flushed(
        u.device_pages_used if u is not None else 0,
        u.device_states_used if u is not None else 0,
        u.host_pages_used if u is not None else 0,
        u.host_states_used if u is not None else 0,
    )
    new = CacheController(
        ctrl.cfg,
        num_pages=ctrl.device_kv.capacity,
        num_slots=ctrl.device_state.capacity,
        num_host_pages=ctrl.host_kv.capacity if ctrl.host_kv is not None else 0,
        num_host_slots=ctrl.host_state.capacity if ctrl.host_state is not None else 0,
    )
    # Counters the metrics report as deltas continue where they were.
    new.evicted_pages, new.evicted_states = ctrl.evicted_pages, ctrl.evicted_states
    new.host_copies = ctrl.host_copies
    new.failed_transfers = ctrl.failed_transfers
    old = ctrl.storage
    if old is not None:
        tier = new.attach_storage(old.io, old.fingerprint)
        if tier is not None:
            # What the store acknowledged is still there (it is not flushed): no need to write it again.
            tier.stored, tier.stored_states, tier.counters = old.stored, old.stored_states, old.counters
            tier._reconnects_seen = old._reconnects_seen
    return new, freed
