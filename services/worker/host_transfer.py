"""Device <-> host copies of KV pages and recurrent states, as ordered by the cache controller.

The host pools are shared-memory views (common/host_pool.py). On CUDA the host side is a
plain (not pinned) mapping; copies are synchronous on the worker's stream, which keeps the
ordering guarantee the cache controller relies on: an order runs before any later forward.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from himamba.common.host_layout import HostPoolLayout, StateComponentLayout
from himamba.common.host_pool import HostPools, open_host_pools
from himamba.common.messages import SeqPlan, Transfer
from himamba.services.worker.pools import KVPool, StatePool

_log = logging.getLogger("himamba.worker")

_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def host_layout(kv: KVPool, state: StatePool, num_pages: int, num_slots: int) -> HostPoolLayout:
    """The shared-memory layout matching the device pools (names unique to this process)."""
    comps = []
    offset = 0
    for li, layer in enumerate(state.spec.layers):
        for c in layer:
            comps.append(StateComponentLayout(li, c.name, tuple(c.shape), _NAMES[c.dtype], offset))
            offset += -(-c.nbytes() // 8) * 8  # keep every component 8-byte aligned
    tag = f"himamba-{os.getpid()}-{id(kv) & 0xFFFF:x}"
    return HostPoolLayout(
        kv_name=f"{tag}-kv" if num_pages else "",
        num_pages=num_pages,
        page_size=kv.page_size,
        num_kv_layers=kv.spec.num_layers,
        num_kv_heads=kv.spec.num_kv_heads,
        head_dim=kv.spec.head_dim,
        kv_dtype=_NAMES[kv.spec.dtype],
        state_name=f"{tag}-state" if num_slots else "",
        num_slots=num_slots,
        state_components=comps,
        state_slot_bytes=max(offset, 8),
    )


class TransferFault(RuntimeError):
    """A copy order failed on purpose (the debug fault-injection hook)."""


class CopyFaults:
    """The test hooks of the copy path (CacheConfig.debug_*_at*), counted over copy orders: the
    Nth order fails, the batch carrying the Nth order fails after its copies, the process dies
    during the Nth order (its KV pages copied, its states not).

    The exit hook fires once per server instance: with `exit_marker` it creates that file as it
    fires and is off in a process that finds the file, so a worker restarted by a supervisor (same
    config, same environment) does not die again at its own Nth order."""

    def __init__(
        self, fail_at: int = 0, batch_fail_at: int = 0, exit_at: int = 0, direction: str = "any",
        exit_marker: Path | None = None,
    ):  # fmt: skip
        self.fail_at, self.batch_fail_at, self.exit_at = fail_at, batch_fail_at, exit_at
        self.direction = direction
        self.exit_marker = exit_marker
        if exit_at and exit_marker is not None and exit_marker.exists():
            _log.warning("test hook: the worker already died at a copy order (%s exists): not again", exit_marker)
            self.exit_at = 0
        self.seen = 0
        self.fail_batch = False
        self.dying = False

    def before(self, t: Transfer) -> None:
        if self.direction != "any" and t.direction != self.direction:
            return
        self.seen += 1
        if self.seen == self.exit_at:
            self.dying = True  # in the middle of this order: `midway`
        if self.seen == self.batch_fail_at:
            self.fail_batch = True
        if self.seen == self.fail_at:
            raise TransferFault(f"copy order {t.op_id} failed (debug_transfer_fail_at={self.fail_at})")

    def midway(self) -> None:
        """Between an order's KV copy and its state copy: the exit hook's worker dies here, with
        copies in flight (this order half done, the batch's later ones not started)."""
        if not self.dying:
            return
        if self.exit_marker is not None:
            try:
                self.exit_marker.touch()
            except OSError:
                pass  # it fires again after a restart: the supervisor's problem, not a wrong answer
        os._exit(70)


class TransferOutcome(NamedTuple):
    """How a batch's copy orders ended: each op id is in exactly one list."""

    done: list[int]
    failed: list[int]
    error: str  # why the first failed order failed ("" when none did)


class UnwrittenMemory:
    """Memory a failed copy order should have written and did not: its destinations keep their
    old bytes. Nothing may read them until something writes them again: a copy reading them
    fails, a batch reading them fails (an error, never a silently wrong answer). The cache
    controller rolls back its tree at the same time; this guards the window in between."""

    def __init__(self) -> None:
        self.dev_pages: set[int] = set()
        self.dev_slots: set[int] = set()
        self.host_pages: set[int] = set()
        self.host_slots: set[int] = set()

    def __bool__(self) -> bool:
        return bool(self.dev_pages or self.dev_slots or self.host_pages or self.host_slots)

    def _sides(self, t: Transfer) -> tuple[tuple[set[int], set[int]], tuple[set[int], set[int]]]:
        dev, host = (self.dev_pages, self.dev_slots), (self.host_pages, self.host_slots)
        return (dev, host) if t.direction == "d2h" else (host, dev)

    def reads_unwritten(self, t: Transfer) -> bool:
        (pages, slots), _ = self._sides(t)
        return bool(pages.intersection(t.kv_src) or slots.intersection(t.state_src))

    def failed(self, t: Transfer) -> None:
        _, (pages, slots) = self._sides(t)
        pages.update(t.kv_dst)
        slots.update(t.state_dst)

    def written(self, t: Transfer) -> None:
        _, (pages, slots) = self._sides(t)
        pages.difference_update(t.kv_dst)
        slots.difference_update(t.state_dst)

    def check_batch(self, seqs: Sequence[SeqPlan], tables: Sequence[Any], page_size: int) -> None:
        """ValueError if the batch's forward would read device memory a failed copy never wrote.
        `tables[i]` is seqs[i]'s page table (its `slots`: token slots, `num_pages`)."""
        if not (self.dev_pages or self.dev_slots):
            return
        for s, pages in zip(seqs, _pages_of(tables, page_size)):
            read = pages[: -(-s.prefix_len // page_size)]
            bad = self.dev_pages.intersection(read)
            src = s.state_src if s.state_init == "copy" else s.state_slot if s.state_init == "keep" and s.prefix_len else None
            if bad or (src is not None and src in self.dev_slots):
                raise ValueError(f"{s.rid}: reads device memory that a failed copy order never wrote")

    def batch_ran(self, seqs: Sequence[SeqPlan], tables: Sequence[Any], page_size: int) -> None:
        """The forward wrote its new tokens' pages and its state slots."""
        if not (self.dev_pages or self.dev_slots):
            return
        for s, pages in zip(seqs, _pages_of(tables, page_size)):
            self.dev_pages.difference_update(pages[s.prefix_len // page_size :])
            self.dev_slots.discard(s.state_slot)
            self.dev_slots.difference_update(slot for _, slot in s.captures)

    def slots_zeroed(self, slots: Sequence[int]) -> None:
        self.dev_slots.difference_update(slots)


def _pages_of(tables: Sequence[Any], page_size: int) -> list[list[int]]:
    return [(t.slots[: t.num_pages * page_size : page_size] // page_size).tolist() for t in tables]


class HostTransfer:
    """Executes Transfer orders between the device pools and the shared host pools."""

    def __init__(
        self, kv: KVPool, state: StatePool, layout: HostPoolLayout, device: torch.device, faults: CopyFaults | None = None
    ):
        self.device = device
        self.kv = kv
        self.state = state
        self.layout = layout
        self.host: HostPools = open_host_pools(layout, create=True)
        self.faults = faults or CopyFaults()
        self.unwritten = UnwrittenMemory()

    def run_orders(self, transfers: Sequence[Transfer]) -> TransferOutcome:
        """Run a batch's copy orders in order; never raises. An order either ran whole (done) or
        failed; after a failure the rest of the batch's orders fail too without running, since a
        later order may read what the failed one should have written. A failed order's
        destinations are remembered as unwritten (`self.unwritten`)."""
        done: list[int] = []
        failed: list[int] = []
        error = ""
        for t in transfers:
            if not failed:
                try:
                    self.faults.before(t)
                    if self.unwritten.reads_unwritten(t):
                        raise ValueError(f"copy order {t.op_id} reads memory that a failed copy order never wrote")
                    self.run(t)
                except Exception as e:  # noqa: BLE001 - any failure ends the order as failed, reported
                    error = f"{type(e).__name__}: {e}"
                else:
                    if self.unwritten:
                        self.unwritten.written(t)
                    done.append(t.op_id)
                    continue
            self.unwritten.failed(t)
            failed.append(t.op_id)
        return TransferOutcome(done, failed, error)

    def close(self) -> None:
        self.host.close(unlink=True)

    def _token_slots(self, pages: list[int]) -> torch.Tensor:
        ps = self.kv.page_size
        p = torch.tensor(pages, dtype=torch.int64, device=self.device)
        return (p.view(-1, 1) * ps + torch.arange(ps, device=p.device)).view(-1)

    def run(self, t: Transfer) -> None:
        if len(t.kv_src) != len(t.kv_dst) or len(t.state_src) != len(t.state_dst):
            raise ValueError(f"transfer {t.op_id}: source and destination lengths differ")
        if t.direction == "d2h":
            self._kv_d2h(t.kv_src, t.kv_dst)
            self.faults.midway()
            self._state_copy(t.state_src, t.state_dst, to_host=True)
        else:
            self._kv_h2d(t.kv_src, t.kv_dst)
            self.faults.midway()
            self._state_copy(t.state_src, t.state_dst, to_host=False)

    def _kv_d2h(self, dev_pages: list[int], host_pages: list[int]) -> None:
        if not dev_pages:
            return
        assert self.host.kv is not None
        slots = self._token_slots(dev_pages)
        hidx = torch.tensor(host_pages, dtype=torch.int64)
        n, ps = len(dev_pages), self.kv.page_size
        for layer, (k, v) in enumerate(zip(self.kv.k, self.kv.v)):
            self.host.kv[hidx, layer, 0] = k.index_select(0, slots).view(n, ps, *k.shape[1:]).cpu()
            self.host.kv[hidx, layer, 1] = v.index_select(0, slots).view(n, ps, *v.shape[1:]).cpu()

    def _kv_h2d(self, host_pages: list[int], dev_pages: list[int]) -> None:
        if not dev_pages:
            return
        assert self.host.kv is not None
        slots = self._token_slots(dev_pages)
        hidx = torch.tensor(host_pages, dtype=torch.int64)
        for layer, (k, v) in enumerate(zip(self.kv.k, self.kv.v)):
            k.index_copy_(0, slots, self.host.kv[hidx, layer, 0].reshape(-1, *k.shape[1:]).to(k.device))
            v.index_copy_(0, slots, self.host.kv[hidx, layer, 1].reshape(-1, *v.shape[1:]).to(v.device))

    def _state_copy(self, src: list[int], dst: list[int], to_host: bool) -> None:
        if not src:
            return
        dev_idx = torch.tensor(src if to_host else dst, dtype=torch.int64, device=self.device)
        host_idx = torch.tensor(dst if to_host else src, dtype=torch.int64)
        for li, layer in enumerate(self.state.tensors):
            for name, dev in layer.items():
                host = self.host.state[(li, name)]
                if to_host:
                    host[host_idx] = dev.index_select(0, dev_idx).cpu()
                else:
                    dev.index_copy_(0, dev_idx, host[host_idx].to(dev.device))
