"""Host-tier pools in shared memory, mapped by the worker (device<->host copies) and the cache
controller (storage I/O) without copies.

Host KV is page-first: one host page holds `page_size` tokens of every attention layer, K and V,
contiguously, so a page goes to storage as one blob. Host state is slot-first: one slot holds
every component of every recurrent layer contiguously.

The worker creates the segments (it knows the model's shapes) and unlinks them at exit; it
announces their names and layout in WorkerInfo; others attach by name. Under tensor parallelism rank 0
creates them with room for every rank's shard of each page and slot (rank after rank), each rank maps
its own shard, and the cache controller sees whole pages and slots: a page still goes to storage as
one blob.
"""

from __future__ import annotations

import warnings
from multiprocessing import resource_tracker, shared_memory
from typing import NamedTuple

import torch

from himamba.common.host_layout import HostPoolLayout, StateComponentLayout

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

__all__ = ["HostPoolLayout", "HostPools", "StateComponentLayout", "open_host_pools"]


class HostPools(NamedTuple):
    """Tensor views over the shared segments. `kv`: [pages, layers, 2, page_size, heads, dim];
    `state[(layer, name)]`: [slots, *shape]; `kv_bytes` / `state_bytes`: raw uint8 views (a rank's
    shard of each page and slot, or, for `rank=None`, whole pages and slots with no typed views)."""

    kv: torch.Tensor | None
    kv_bytes: torch.Tensor | None
    state: dict[tuple[int, str], torch.Tensor]
    state_bytes: torch.Tensor | None
    segments: list[shared_memory.SharedMemory]

    def close(self, unlink: bool = False) -> None:
        for seg in self.segments:
            try:
                seg.close()
            except BufferError:
                pass  # a view is still alive; the OS unmaps at exit
            if unlink:
                try:
                    seg.unlink()
                except FileNotFoundError:
                    pass


def _segment(name: str, size: int, create: bool) -> shared_memory.SharedMemory:
    if create:
        return shared_memory.SharedMemory(name=name, create=True, size=max(size, 1))
    seg = shared_memory.SharedMemory(name=name, create=False)
    # Python 3.11 registers attached segments with the resource tracker, which would unlink
    # the creator's segment when this process exits.
    resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]
    return seg


def _view(seg: shared_memory.SharedMemory, nbytes: int) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(seg.buf, dtype=torch.uint8, count=nbytes)


def open_host_pools(layout: HostPoolLayout, create: bool, rank: int | None = 0) -> HostPools:
    """Create (the worker, rank 0) or attach to (the other ranks, the cache controller) the shared host
    pools; the views are `rank`'s shard, or whole pages and slots (raw bytes only) for None."""
    segments = []
    tp = layout.tp_size
    whole = rank is None and tp > 1  # the controller's view of a sharded pool: bytes, whole pages
    kv = kv_bytes = state_bytes = None
    state: dict[tuple[int, str], torch.Tensor] = {}
    if layout.num_pages and layout.kv_name and layout.page_bytes == 0:
        # A model without attention layers: host pages exist for bookkeeping but hold no bytes,
        # and shared memory cannot map an empty segment.
        kv_bytes = torch.empty((layout.num_pages, 0), dtype=torch.uint8)
        kv = torch.empty(
            (layout.num_pages, 0, 2, layout.page_size, layout.num_kv_heads, layout.head_dim), dtype=_DTYPES[layout.kv_dtype]
        )
    elif layout.num_pages and layout.kv_name:
        nbytes = layout.num_pages * layout.page_bytes * tp
        seg = _segment(layout.kv_name, nbytes, create)
        segments.append(seg)
        kv_bytes = _view(seg, nbytes).view(layout.num_pages, layout.page_bytes * tp)
        if not whole:
            at = (rank or 0) * layout.page_bytes
            kv_bytes = kv_bytes[:, at : at + layout.page_bytes]
            # Rows of a rank's shard are strided, each contiguous: the typed view splits the last dim only.
            kv = kv_bytes.view(_DTYPES[layout.kv_dtype]).view(
                layout.num_pages, layout.num_kv_layers, 2, layout.page_size, layout.num_kv_heads, layout.head_dim
            )
    if layout.num_slots and layout.state_name:
        nbytes = layout.num_slots * layout.state_slot_bytes * tp
        seg = _segment(layout.state_name, nbytes, create)
        segments.append(seg)
        state_bytes = _view(seg, nbytes).view(layout.num_slots, layout.state_slot_bytes * tp)
        if not whole:
            at = (rank or 0) * layout.state_slot_bytes
            state_bytes = state_bytes[:, at : at + layout.state_slot_bytes]
        for c in () if whole else layout.state_components:
            dtype = _DTYPES[c.dtype]
            n = dtype.itemsize
            for d in c.shape:
                n *= d
            state[(c.layer, c.name)] = state_bytes[:, c.offset : c.offset + n].view(dtype).view(layout.num_slots, *c.shape)
    return HostPools(kv, kv_bytes, state, state_bytes, segments)
