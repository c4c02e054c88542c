"""CacheController: the memory metadata of one server, with no I/O of its own.

It owns the allocators of every pool, the radix tree, and the table of what each running
request holds (pages, state slots, the lock receipt of its cached prefix). The cache service
feeds it the scheduler's ops and sends back its results; tests drive it directly.

Page ownership of a running request: `pages[:num_shared]` belong to the tree (the matched
prefix, protected by the request's lock); `pages[num_shared:]` belong to the request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import NamedTuple

from himamba.common.config import CacheConfig
from himamba.common.messages import (
    Admit,
    Admitted,
    AllocSlots,
    CacheOp,
    CacheResult,
    CacheStats,
    CancelPrefetch,
    Extend,
    Extended,
    FreeSlots,
    Insert,
    Inserted,
    Prefetch,
    PrefetchCancelled,
    PrefetchStarted,
    Release,
    Released,
    SlotsAllocated,
    SlotsFreed,
    Transfer,
)
from himamba.common.types import CachedTokens
from himamba.services.cache.allocator import PageAllocator, SlotAllocator
from himamba.services.cache.storage.io_workers import StorageIO
from himamba.services.cache.storage_tier import StorageTier
from himamba.services.cache.tree.node import LockReceipt, TreeNode
from himamba.services.cache.tree.orders import BackupOp, LoadOp
from himamba.services.cache.tree.radix_tree import RadixTree
from himamba.services.cache.tree.results import InsertResult, MatchResult

_log = logging.getLogger("himamba.cache")


@dataclass
class RequestAlloc:
    """What one running request holds."""

    rid: str
    pages: list[int] = field(default_factory=list)
    num_shared: int = 0  # leading pages owned by the tree
    slots: list[int] = field(default_factory=list)
    receipt: LockReceipt | None = None  # the tree's lock on the shared prefix


class _AdmitPlan(NamedTuple):
    """How an Admit will be served, decided before anything is evicted or allocated."""

    node: TreeNode  # the cached prefix to lock (the root for none)
    cached_len: int
    load: bool  # load root..node's host part back to device first


def _path_pages(node: TreeNode) -> list[int]:
    """Device pages of root..node (the whole path must be on device)."""
    parts = []
    while node.parent is not None:
        assert node.device_pages is not None, f"node {node.id} is not on device"
        parts.append(node.device_pages)
        node = node.parent
    return [p for part in reversed(parts) for p in part]


@dataclass
class HostCopyCounts:
    """Device<->host copies the worker acknowledged: backups (d2h) and load-backs (h2d)."""

    backup_ops: int = 0
    backup_pages: int = 0
    backup_states: int = 0
    load_ops: int = 0
    load_pages: int = 0
    load_states: int = 0

    def count(self, op: BackupOp | LoadOp) -> None:
        if isinstance(op, LoadOp):
            self.load_ops += 1
            self.load_pages += len(op.host_pages)
            self.load_states += len(op.host_states)
        else:
            self.backup_ops += 1
            self.backup_pages += len(op.host_pages)
            self.backup_states += len(op.host_states)


class CacheController:
    """Answers the scheduler's Admit/Extend/Insert/Release; see the module docstring."""

    def __init__(
        self,
        cfg: CacheConfig,
        num_pages: int,
        num_slots: int,
        num_host_pages: int = 0,
        num_host_slots: int = 0,
    ):
        self.evicted_pages = 0
        self.evicted_states = 0
        self.host_copies = HostCopyCounts()  # acknowledged device<->host copies, for metrics
        self.failed_transfers = 0  # copy orders the worker reported failed (rolled back)
        self.cfg = cfg
        self.page_size = cfg.page_size
        self.device_kv = PageAllocator(num_pages)
        self.device_state = SlotAllocator(num_slots)
        self.host_kv = PageAllocator(num_host_pages) if num_host_pages else None
        self.host_state = SlotAllocator(num_host_slots) if num_host_slots else None
        self.tree: RadixTree | None = None
        if not cfg.disable_radix_cache:
            self.tree = RadixTree(
                cfg.page_size,
                self.device_kv,
                self.device_state,
                self.host_kv,
                self.host_state,
                write_policy=cfg.hicache_write_policy,
                eviction_policy=cfg.eviction_policy,
            )
        self.requests: dict[str, RequestAlloc] = {}
        # Slots set aside for sibling samples (n > 1) that are not admitted yet, by their rid.
        self.reserved: dict[str, list[int]] = {}
        # Requests told to wait for their prefetch; `take_prefetch_ready` reports when they may go.
        self.awaiting_prefetch: set[str] = set()
        self.pending: dict[int, BackupOp | LoadOp] = {}  # op_id -> tree op awaiting the worker's ack
        self._transfers: list[Transfer] = []  # produced since the last take_transfers()
        self.storage: StorageTier | None = None  # set by attach_storage

    def attach_storage(self, io: StorageIO, fingerprint: bytes) -> StorageTier | None:
        """Turn on the storage tier over `io` (a StorageIO on the shared host pools); needs the
        radix cache and a host tier, else does nothing and returns None."""
        if self.tree is None or self.host_kv is None:
            return None
        self.storage = StorageTier(self.cfg, self.tree, self.host_kv, self.host_state, io, fingerprint)
        return self.storage

    # ------------------------------------------------------------ copy orders

    def _order_backups(self, ops: list[BackupOp]) -> None:
        for op in ops:
            self.pending[op.op_id] = op
            self._transfers.append(
                Transfer(
                    op.op_id,
                    "d2h",
                    list(op.device_pages),
                    list(op.host_pages),
                    list(op.device_states),
                    list(op.host_states),
                )
            )

    def _order_load(self, op: LoadOp) -> None:
        self._order_backups(op.backups)  # room was made by write_back evictions: copy those first
        self.pending[op.op_id] = op
        self._transfers.append(
            Transfer(
                op.op_id,
                "h2d",
                list(op.host_pages),
                list(op.device_pages),
                list(op.host_states),
                list(op.device_states),
            )
        )

    def take_transfers(self) -> list[Transfer]:
        """Copy orders produced by the ops applied since the last call, in execution order."""
        out, self._transfers = self._transfers, []
        if self.tree is not None and self.tree.usage().taints:
            self.tree.retry_rollbacks()  # the step's Releases may have unlocked what a failed copy left
        return out

    def transfers_done(self, op_ids: list[int], failed: list[int] | tuple[int, ...] = ()) -> None:
        """The worker executed `op_ids` (release what the tree protected for them) and could not
        execute `failed` (roll back what they assigned: see `transfers_failed`)."""
        self.transfers_failed(failed)
        assert self.tree is not None or not op_ids
        for op_id in op_ids:
            op = self.pending.pop(op_id, None)
            if op is None:
                continue
            self.host_copies.count(op)
            assert self.tree is not None
            if isinstance(op, LoadOp):
                self.tree.load_back_done(op)
            else:
                self.tree.backup_done(op)
                if self.storage is not None:
                    # The host copy is acknowledged: now storage may read it.
                    self.storage.backup(op.node)

    def transfers_failed(self, op_ids: list[int] | tuple[int, ...]) -> None:
        """The worker could not execute these orders: the tree releases their pins and forgets the
        copies they would have written (a failed load leaves the host copy, a failed backup the
        device one), so no later hit reads memory that was never written."""
        for op_id in op_ids:
            op = self.pending.pop(op_id, None)
            if op is None:
                continue  # unknown or already ended: an order ends once
            self.failed_transfers += 1
            assert self.tree is not None
            if isinstance(op, LoadOp):
                self.tree.load_back_failed(op)
            else:
                self.tree.backup_failed(op)

    # ------------------------------------------------------------ allocation (check, then evict)

    def pages_available(self) -> int:
        """Device pages that can be had now: free, or cached and unlocked (evictable)."""
        return self.device_kv.num_free + (self.tree.usage().device_pages_evictable if self.tree is not None else 0)

    def slots_available(self) -> int:
        """Device state slots that can be had now: free, or cached states that are not locked."""
        return self.device_state.num_free + (self.tree.usage().device_states_evictable if self.tree is not None else 0)

    def _alloc_pages(self, n: int) -> list[int] | None:
        """`n` device pages, evicting cached ones only when that is sure to give enough."""
        if n <= 0:
            return []
        pages = self.device_kv.alloc(n)
        if pages is None and self.tree is not None and self.pages_available() >= n:
            r = self.tree.evict(n - self.device_kv.num_free)
            self.evicted_pages += r.num_pages
            self._order_backups(r.backups)
            pages = self.device_kv.alloc(n)
        return pages

    def _alloc_slots(self, n: int) -> list[int] | None:
        """`n` device state slots, evicting cached states only when that is sure to give enough."""
        if n <= 0:
            return []
        slots = self.device_state.alloc(n)
        if slots is None and self.tree is not None and self.slots_available() >= n:
            r = self.tree.evict_state(n - self.device_state.num_free)
            self.evicted_states += r.num_states
            self._order_backups(r.backups)
            slots = self.device_state.alloc(n)
        return slots

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ------------------------------------------------------------ ops

    def poll_storage(self) -> None:
        """Pick up finished storage lookups and jobs (the service calls this periodically)."""
        if self.storage is not None:
            self.storage.poll()

    def take_prefetch_ready(self) -> list[str]:
        """Requests told to wait for their prefetch whose wait is over (done, given up, past the
        deadline): the service tells the scheduler, which retries their admission then."""
        if not self.awaiting_prefetch:
            return []
        storage = self.storage
        ready = [rid for rid in self.awaiting_prefetch if storage is None or not storage.waits(rid)]
        self.awaiting_prefetch.difference_update(ready)
        return ready

    def apply_step(self, ops: list[CacheOp]) -> list[CacheResult]:
        """One CacheStep: every op in order, one result each. Admits are FCFS: after the first
        that does not fit (not one still waiting for its prefetch), the rest are not tried."""
        self.poll_storage()
        results: list[CacheResult] = []
        blocked_by = ""
        for op in ops:
            if isinstance(op, Admit) and blocked_by:
                results.append(Admitted(rid=op.rid, ok=False, blocked=True, reason=f"waiting behind {blocked_by}"))
                continue
            res = self.apply(op)
            if isinstance(res, Admitted) and not res.ok and not res.prefetching:
                blocked_by = op.rid
            results.append(res)
        return results

    def apply(self, op: CacheOp) -> CacheResult:
        """Apply one op; its result is always of type RESULT_OF[type(op)]."""
        match op:
            case Admit():
                return self.admit(op)
            case Extend():
                return self.extend(op)
            case AllocSlots():
                return self.alloc_slots(op)
            case FreeSlots():
                return self.free_slots(op)
            case Insert():
                return self.insert(op)
            case Release():
                return self.release(op)
            case Prefetch():
                return self.prefetch(op)
            case CancelPrefetch():
                if self.storage is not None:
                    self.storage.cancel(op.rid)
                self.awaiting_prefetch.discard(op.rid)
                return PrefetchCancelled(rid=op.rid)
        raise ValueError(f"unknown cache op {type(op).__name__}")

    def prefetch(self, op: Prefetch) -> PrefetchStarted:
        if self.storage is None or self.tree is None or not op.tokens:
            return PrefetchStarted(rid=op.rid, started=False)
        p = self.tree.probe(op.tokens[: len(op.tokens) - 1])
        self.storage.start(op.rid, list(op.tokens), p.cached_len, p.host_len)
        return PrefetchStarted(rid=op.rid, started=op.rid in self.storage.prefetches)

    def _fits(self, node: TreeNode, pages: int, slots: int) -> bool:
        """Whether `pages` device pages and `slots` state slots can be had with `node` locked as the
        request will hold it (what stays evictable can all be had). Decides on counts: it locks
        nothing, so it changes nothing (no eviction queue is touched either)."""
        assert self.tree is not None
        held = self.tree.lock_cost(node)
        return self.pages_available() - held.pages >= pages and self.slots_available() - held.states >= slots

    def _plan_admit(self, m: MatchResult, need_pages: int, need_slots: int) -> _AdmitPlan | None:
        """The deepest hit that fits in what is free or evictable, or None when even a plain
        prefill does not fit. Decides without evicting or allocating anything."""
        assert self.tree is not None
        ps = self.page_size
        if m.state_tier == "host" or m.host_len > 0:
            # Load root..node's host part back: pages for it and for the rest, a slot for a host state.
            load_state = 1 if m.state_tier == "host" else 0
            if self._fits(m.node, need_pages - m.device_len // ps, need_slots + load_state):
                return _AdmitPlan(m.node, m.cached_len, True)
        if m.device_cached_len > 0 and self._fits(m.device_node, need_pages - m.device_cached_len // ps, need_slots):
            return _AdmitPlan(m.device_node, m.device_cached_len, False)
        if self._fits(self.tree.root, need_pages, need_slots):
            return _AdmitPlan(self.tree.root, 0, False)
        return None

    def admit(self, op: Admit) -> Admitted:
        if op.rid in self.requests:
            return Admitted(rid=op.rid, ok=False, reason="duplicate rid")
        if op.num_slots < 1 or len(set(op.reserve)) != len(op.reserve) or op.rid in op.reserve:
            return Admitted(rid=op.rid, ok=False, reason="bad admission: num_slots < 1 or repeated sample rids")
        taken = [s for s in op.reserve if s in self.reserved or s in self.requests]
        if taken:
            # Obeying would overwrite a reservation (its slots then owned by nobody) or reserve for
            # a sample already running: refused, as a slot the request does not hold is.
            return Admitted(rid=op.rid, ok=False, reason=f"bad admission: {taken[0]} is already reserved or running")
        from_storage = (0, 0)
        if self.storage is not None and op.use_cache:
            gate = self.storage.admit_gate(op.rid)
            if gate.wait:
                self.awaiting_prefetch.add(op.rid)
                return Admitted(rid=op.rid, ok=False, prefetching=True, reason="prefix arriving from storage")
            from_storage = gate.storage_range
        self.awaiting_prefetch.discard(op.rid)
        tokens = op.tokens
        need_pages = self._pages_for(len(tokens))
        held = self.reserved.get(op.rid, [])
        need_slots = max(op.num_slots - len(held), 0) + op.num_slots * len(op.reserve)
        use_tree = self.tree is not None and op.use_cache
        m: MatchResult | None = None
        plan: _AdmitPlan | None = None
        if use_tree and len(tokens) > 1:
            assert self.tree is not None
            # At least one token must be computed to get logits: match all but the last.
            m = self.tree.match_prefix(tokens[: len(tokens) - 1], touch=False)
            plan = self._plan_admit(m, need_pages, need_slots)
            fits = plan is not None
        else:
            fits = self.pages_available() >= need_pages and self.slots_available() >= need_slots
        if not fits:
            what = "KV pages" if self.pages_available() < need_pages else "state slots"
            return Admitted(rid=op.rid, ok=False, reason=f"not enough {what}")

        # It fits: from here on nothing fails for want of memory.
        shared: list[int] = []
        cached_len = 0
        state_src: int | None = None
        branch_len = 0
        receipt = None
        cached = CachedTokens()
        if m is not None and plan is not None:
            assert self.tree is not None
            m = self.tree.record_hit(m)  # a request's hit is counted once, when it is served
            self._order_backups(m.backups)
            node, cached_len = plan.node, plan.cached_len
            cached = CachedTokens(device=cached_len)
            load = self.tree.load_back(m.node) if plan.load else None
            if plan.load and load is None:  # not expected: load_back counts as _plan_admit did
                node, cached_len = m.device_node, m.device_cached_len
                cached = CachedTokens(device=cached_len)
            if load is not None:
                self._order_load(load)
                # Of the tokens loaded from host, those this request's prefetch brought up.
                lo, hi = from_storage
                st = max(0, min(hi, m.cached_len) - max(lo, m.device_len))
                cached = CachedTokens(device=m.device_len, host=m.cached_len - m.device_len - st, storage=st)
            if cached_len > 0:
                receipt = self.tree.lock(node)
                shared = _path_pages(node)
                state_src = node.device_state
            if m.kv_match_len > cached_len:
                branch_len = m.kv_match_len
        own = self._alloc_pages(need_pages - len(shared))
        fresh = self._alloc_slots(need_slots) if own is not None else None
        if own is None or fresh is None:
            # Not expected (the fit check counts what eviction can free), but a refusal here must
            # cost this request only, never the controller: give back what it got, and say so.
            _log.error("%s: allocation failed after the fit check (%d pages, %d slots)", op.rid, need_pages, need_slots)
            if own:
                self.device_kv.free(own)
            if receipt is not None:
                assert self.tree is not None
                self.tree.unlock(receipt)
            return Admitted(rid=op.rid, ok=False, reason="not enough memory (allocation failed after the fit check)")
        self.reserved.pop(op.rid, None)
        mine = max(op.num_slots - len(held), 0)
        slots = held + fresh[:mine]
        for i, sibling in enumerate(op.reserve):
            self.reserved[sibling] = fresh[mine + i * op.num_slots : mine + (i + 1) * op.num_slots]
        captures = self._plan_captures(len(tokens), cached_len, branch_len) if use_tree else []
        slots = slots + [slot for _, slot in captures]
        self.requests[op.rid] = RequestAlloc(op.rid, shared + own, len(shared), slots, receipt)
        if self.storage is not None:
            self.storage.consume(op.rid)  # the request holds its prefix now: drop the prefetch's pin
        return Admitted(
            rid=op.rid,
            ok=True,
            pages=shared + own,
            slots=slots,
            cached_len=cached_len,
            cached=cached,
            state_src=state_src,
            branch_len=branch_len,
            captures=captures,
        )

    def _plan_captures(self, num_tokens: int, cached_len: int, branch_len: int) -> list[tuple[int, int]]:
        """Where this prefill should checkpoint its state for the tree, each with a slot.

        The branch point (where a cached KV path continues past the deepest cached state), the
        last whole page of the context (a follow-up turn continues from there) and the last page
        boundary before the final token (the most an identical prompt can reuse, since one token
        must always be computed; differs from the previous one when the length is page-aligned).
        Best effort: no slot, no checkpoint.
        """
        ps = self.page_size
        positions = {branch_len, num_tokens - num_tokens % ps, (num_tokens - 1) - (num_tokens - 1) % ps}
        out = []
        for pos in sorted(p for p in positions if cached_len < p <= num_tokens and p > 0):
            slot = self._alloc_slots(1)
            if slot is None:
                break
            out.append((pos, slot[0]))
        return out

    def extend(self, op: Extend) -> Extended:
        req = self.requests.get(op.rid)
        if req is None:
            return Extended(rid=op.rid, ok=False, error=f"unknown request {op.rid}")
        need = self._pages_for(op.total_len) - len(req.pages)
        new = self._alloc_pages(need)
        if new is None:
            return Extended(rid=op.rid, ok=False)
        req.pages.extend(new)
        return Extended(rid=op.rid, ok=True, new_pages=new)

    def alloc_slots(self, op: AllocSlots) -> SlotsAllocated:
        req = self.requests.get(op.rid)
        if req is None:
            return SlotsAllocated(rid=op.rid, ok=False, error=f"unknown request {op.rid}")
        slots = self._alloc_slots(op.num)
        if slots is None:
            return SlotsAllocated(rid=op.rid, ok=False)
        req.slots.extend(slots)
        return SlotsAllocated(rid=op.rid, ok=True, slots=slots)

    def free_slots(self, op: FreeSlots) -> SlotsFreed:
        req = self.requests.get(op.rid)
        if req is None:
            return SlotsFreed(rid=op.rid, ok=False, error=f"unknown request {op.rid}")
        foreign = [s for s in op.slots if s not in req.slots]
        if foreign or len(set(op.slots)) != len(op.slots):
            return SlotsFreed(rid=op.rid, ok=False, error=f"slots {foreign or op.slots} are not held by {op.rid}")
        for s in op.slots:
            req.slots.remove(s)
        self.device_state.free(op.slots)
        return SlotsFreed(rid=op.rid, ok=True)

    def _check_donation(self, req: RequestAlloc, tokens: list[int], slot: int | None) -> str:
        """Why the request cannot give `tokens` (its pages) and `slot` to the tree ("" if it can)."""
        if slot is not None and slot not in req.slots:
            return f"slot {slot} is not held by {req.rid}"
        if len(tokens) // self.page_size > len(req.pages):
            return f"{len(tokens)} tokens are more than the {len(req.pages)} pages {req.rid} holds"
        return ""

    def _insert(self, req: RequestAlloc, tokens: list[int], slot: int | None) -> InsertResult:
        """Give whole pages of `tokens` (and `slot`) to the tree."""
        assert self.tree is not None
        n_pages = len(tokens) // self.page_size
        tokens = tokens[: n_pages * self.page_size]
        if slot is not None:
            req.slots.remove(slot)
        # A prefix shorter than what the request shares with the tree is all the tree's own pages.
        shared = min(req.num_shared, n_pages) * self.page_size
        res = self.tree.insert(tokens, req.pages[:n_pages], slot, locked_prefix_len=shared)
        self._order_backups(res.backups)
        return res

    def insert(self, op: Insert) -> Inserted:
        req = self.requests.get(op.rid)
        if req is None:
            return Inserted(rid=op.rid, ok=False, error=f"unknown request {op.rid}")
        error = self._check_donation(req, list(op.tokens), op.slot)
        if error:
            return Inserted(rid=op.rid, ok=False, error=error)
        if self.tree is None or len(op.tokens) < self.page_size:
            return Inserted(rid=op.rid)
        res = self._insert(req, list(op.tokens), op.slot)
        n = len(res.pages)
        req.pages[:n] = res.pages
        # The request now relies on the inserted node's KV. Its own state is in its working slot, so
        # the donated state is not locked: it can be evicted like any other cached state. A prefix
        # shorter than what it already holds locked is inside that lock: the lock stays where it is.
        if n >= req.num_shared:
            new_receipt = self.tree.lock(res.node, state=False)
            if req.receipt is not None:
                self.tree.unlock(req.receipt)
            req.receipt = new_receipt
            req.num_shared = n
        return Inserted(rid=op.rid, pages=list(res.pages), slot_used=res.state_used)

    def release(self, op: Release) -> Released:
        held = self.reserved.pop(op.rid, None)
        if held is not None:
            self.device_state.free(held)  # a sample that will not be admitted
        req = self.requests.get(op.rid)
        if req is None:
            return Released(rid=op.rid)
        error = self._check_donation(req, list(op.tokens), op.slot)
        if error:
            op = Release(rid=op.rid)  # free everything, insert nothing; say why
        del self.requests[op.rid]
        inserted_pages = 0
        if self.tree is not None and op.tokens and len(op.tokens) >= self.page_size:
            res = self._insert(req, list(op.tokens), op.slot)
            inserted_pages = len(res.pages)
        # Pages the tree now owns (shared prefix or just inserted) are not ours to free.
        first_own = max(req.num_shared, inserted_pages)
        self.device_kv.free(req.pages[first_own:])
        self.device_state.free(req.slots)
        if req.receipt is not None:
            assert self.tree is not None
            self.tree.unlock(req.receipt)
        return Released(rid=op.rid, ok=not error, error=error)

    # ------------------------------------------------------------ inspection

    def stats(self) -> CacheStats:
        u = self.tree.usage() if self.tree is not None else None
        return CacheStats(
            free_pages=self.device_kv.num_free,
            total_pages=self.device_kv.capacity,
            free_slots=self.device_state.num_free,
            total_slots=self.device_state.capacity,
            free_host_pages=self.host_kv.num_free if self.host_kv else 0,
            total_host_pages=self.host_kv.capacity if self.host_kv else 0,
            free_host_slots=self.host_state.num_free if self.host_state else 0,
            total_host_slots=self.host_state.capacity if self.host_state else 0,
            cached_pages=u.device_pages_used if u else 0,
            cached_slots=u.device_states_used if u else 0,
            running_requests=len(self.requests),
            host_pages_protected=u.host_pages_protected if u else 0,
            host_states_protected=u.host_states_protected if u else 0,
            failed_transfers=self.failed_transfers,
        )

    def check_invariants(self) -> None:
        """Every page and slot is free XOR owned by exactly one node or running request."""
        own_pages = [p for r in self.requests.values() for p in r.pages[r.num_shared :]]
        own_slots = [s for r in self.requests.values() for s in r.slots]
        own_slots += [s for held in self.reserved.values() for s in held]
        if self.tree is not None:
            host_pages, host_slots = self.storage.in_flight_host() if self.storage is not None else ([], [])
            self.tree.check_invariants(
                external_device_pages=own_pages,
                external_device_slots=own_slots,
                external_host_pages=host_pages,
                external_host_slots=host_slots,
            )
            return
        free_pages = self.device_kv.capacity - self.device_kv.num_free
        if sorted(own_pages) != sorted(set(own_pages)) or len(own_pages) != free_pages:
            raise AssertionError(f"page accounting: {len(own_pages)} owned vs {free_pages} allocated")
        used_slots = self.device_state.capacity - self.device_state.num_free
        if len(set(own_slots)) != len(own_slots) or len(own_slots) != used_slots:
            raise AssertionError(f"slot accounting: {len(own_slots)} owned vs {used_slots} allocated")
