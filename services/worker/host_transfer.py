"""Device <-> host copies of KV pages and recurrent states, as ordered by the cache controller.

The host pools are shared-memory views (common/host_pool.py). On CUDA the worker registers them with
CUDA (cudaHostRegister), so they are pinned: a copy order then packs its pages (or state slots) in the
host pools' own layout in one device buffer and moves each run of consecutive host pages as one DMA
straight into (or out of) shared memory, 51-55 GB/s on an H200 against 8-15 GB/s for the pageable
copies plus host-side scatter it replaces (docs/results/2026-11-28-h200). Where registration is
refused (gVisor may), copies stay pageable. Either way an order has ended, on the device too, before
it is reported done: the cache controller may hand the host memory to storage I/O at once. Copies run
on the worker's stream, so an order also runs before any later forward.
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


def host_layout(kv: KVPool, state: StatePool, num_pages: int, num_slots: int, tp_size: int = 1) -> HostPoolLayout:
    """The shared-memory layout matching the device pools (names unique to this process); under tensor
    parallelism, rank 0's, with room for every rank's (equal) shard."""
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
        tp_size=tp_size,
    )


class TransferFault(RuntimeError):
    """A copy order failed on purpose (the debug fault-injection hook)."""


class CopyFaults:
    """The test hooks of the copy path (DebugConfig: the [debug] table), counted over copy orders: the
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
            raise TransferFault(f"copy order {t.op_id} failed (debug.transfer_fail_at={self.fail_at})")

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

    def agree(self, transfers: Sequence[Transfer], failed: Sequence[int]) -> None:
        """The ranks' merged outcome failed `failed`, some of which this rank may have done: their
        destinations are unwritten here too, so every rank refuses the same reads (a rank refusing a
        batch alone leaves the others waiting in the forward's collectives)."""
        ids = set(failed)
        for t in transfers:
            if t.op_id in ids:
                self.failed(t)

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
            src = (
                s.state_src
                if s.state_init == "copy"
                else s.state_slot
                if s.state_init == "keep" and s.prefix_len
                else None
            )
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
        self,
        kv: KVPool,
        state: StatePool,
        layout: HostPoolLayout,
        device: torch.device,
        faults: CopyFaults | None = None,
        packed: bool | None = None,
        rank: int = 0,
    ):
        """`packed`: copy orders move packed runs (what pinned host memory allows); None: wherever the
        host pools could be registered with CUDA. Tests set it on the CPU to run that path there.
        `rank`: this worker rank's shard of the pools (rank 0 creates them; the others attach)."""
        self.device = device
        self.kv = kv
        self.state = state
        self.layout = layout
        self.creator = rank == 0
        self.host: HostPools = open_host_pools(layout, create=self.creator, rank=rank)
        self.faults = faults or CopyFaults()
        self.unwritten = UnwrittenMemory()
        self.pinned = pin_host_pools(self.host) if device.type == "cuda" else "not on CUDA"
        self.packed = (self.pinned == "") if packed is None else packed

    def describe(self) -> str:
        """How copy orders run, for the start-up log."""
        if self.packed:
            return (
                "host pools pinned (cudaHostRegister): copies are packed DMA runs"
                if self.pinned == ""
                else "packed runs"
            )
        return f"host copies pageable ({self.pinned})"

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
        if self.pinned == "":
            unpin_host_pools(self.host)
        self.host.close(unlink=self.creator)

    def _token_slots(self, pages: list[int]) -> torch.Tensor:
        ps = self.kv.page_size
        p = torch.tensor(pages, dtype=torch.int64, device=self.device)
        return (p.view(-1, 1) * ps + torch.arange(ps, device=p.device)).view(-1)

    def run(self, t: Transfer) -> None:
        if len(t.kv_src) != len(t.kv_dst) or len(t.state_src) != len(t.state_dst):
            raise ValueError(f"transfer {t.op_id}: source and destination lengths differ")
        to_host = t.direction == "d2h"
        dev_pages, host_pages = (t.kv_src, t.kv_dst) if to_host else (t.kv_dst, t.kv_src)
        dev_slots, host_slots = (t.state_src, t.state_dst) if to_host else (t.state_dst, t.state_src)
        if not self.packed:
            self._kv_d2h(dev_pages, host_pages) if to_host else self._kv_h2d(host_pages, dev_pages)
            self.faults.midway()
            self._state_copy(t.state_src, t.state_dst, to_host)
            return
        self._kv_packed(dev_pages, host_pages, to_host)
        self.faults.midway()
        self._state_packed(dev_slots, host_slots, to_host)
        if self.device.type == "cuda":
            # Done means done on the device too: the controller may reuse the host memory at once.
            torch.cuda.current_stream(self.device).synchronize()

    def _kv_packed(self, dev_pages: list[int], host_pages: list[int], to_host: bool) -> None:
        """KV pages through one device buffer in the host layout [n, layers, 2, page_size, heads, dim]:
        a gather (or scatter) per layer and K/V on the device, one DMA per run of consecutive host pages."""
        if not dev_pages:
            return
        assert self.host.kv is not None
        n, ps, layers = len(dev_pages), self.kv.page_size, len(self.kv.k)
        slots = self._token_slots(dev_pages)
        stage = torch.empty((n, *self.host.kv.shape[1:]), dtype=self.host.kv.dtype, device=self.device)
        if to_host:
            for layer in range(layers):
                for kv_i, pool in enumerate((self.kv.k[layer], self.kv.v[layer])):
                    stage[:, layer, kv_i] = pool.index_select(0, slots).view(n, ps, *pool.shape[1:])
        copy_runs(self.host.kv, stage, host_pages, to_host)
        if not to_host:
            for layer in range(layers):
                for kv_i, pool in enumerate((self.kv.k[layer], self.kv.v[layer])):
                    pool.index_copy_(0, slots, stage[:, layer, kv_i].reshape(-1, *pool.shape[1:]))

    def _state_packed(self, dev_slots: list[int], host_slots: list[int], to_host: bool) -> None:
        """State slots through one device buffer of host slot rows (every component at its offset),
        one DMA per run of consecutive host slots."""
        if not dev_slots:
            return
        assert self.host.state_bytes is not None
        n = len(dev_slots)
        idx = torch.tensor(dev_slots, dtype=torch.int64, device=self.device)
        stage = torch.empty((n, self.host.state_bytes.shape[1]), dtype=torch.uint8, device=self.device)
        fields = [(li, name, dev, self.host.state[(li, name)]) for li, layer in enumerate(self.state.tensors)
                  for name, dev in layer.items()]  # fmt: skip
        offsets = {(c.layer, c.name): c.offset for c in self.layout.state_components}
        if to_host:
            for li, name, dev, _ in fields:
                rows = dev.index_select(0, idx).reshape(n, -1).view(torch.uint8)
                at = offsets[(li, name)]
                stage[:, at : at + rows.shape[1]] = rows
        copy_runs(self.host.state_bytes, stage, host_slots, to_host)
        if not to_host:
            for li, name, dev, _ in fields:
                at = offsets[(li, name)]
                width = dev[0].numel() * dev.element_size()
                rows = stage[:, at : at + width].contiguous().view(dev.dtype).view(n, *dev.shape[1:])
                dev.index_copy_(0, idx, rows)

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


def host_runs(host_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(position in the order, first host id, length) of each run of consecutive host ids, in order:
    one DMA each."""
    runs: list[tuple[int, int, int]] = []
    for i, h in enumerate(host_ids):
        if runs and runs[-1][1] + runs[-1][2] == h:
            at, first, length = runs[-1]
            runs[-1] = (at, first, length + 1)
        else:
            runs.append((i, h, 1))
    return runs


def copy_runs(host: torch.Tensor, stage: torch.Tensor, host_ids: Sequence[int], to_host: bool) -> None:
    """Rows of `stage` (in order) to or from rows `host_ids` of `host`: one copy per run of
    consecutive host rows, asynchronous where the host memory is pinned."""
    for at, host_at, length in host_runs(host_ids):
        if to_host:
            host[host_at : host_at + length].copy_(stage[at : at + length], non_blocking=True)
        else:
            stage[at : at + length].copy_(host[host_at : host_at + length], non_blocking=True)


def pin_host_pools(host: HostPools) -> str:
    """cudaHostRegister every shared segment of the host pools; '' when all are pinned, else why not
    (and none stays registered)."""
    done: list[torch.Tensor] = []
    for view in (host.kv_bytes, host.state_bytes):
        if view is None or view.numel() == 0:
            continue
        err = torch.cuda.cudart().cudaHostRegister(view.data_ptr(), view.numel(), 0)
        if int(err) != 0:
            for t in done:
                torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
            return f"cudaHostRegister refused the host pools: {err}"
        done.append(view)
    return ""


def unpin_host_pools(host: HostPools) -> None:
    for view in (host.kv_bytes, host.state_bytes):
        if view is not None and view.numel():
            torch.cuda.cudart().cudaHostUnregister(view.data_ptr())
