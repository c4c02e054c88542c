"""StorageTier: the cache controller's glue between the radix tree and the storage I/O workers.

Backup: once a device -> host copy is acknowledged, the host pages of root..node that storage does
not hold yet go to storage in the background (every write policy: under write_back host copies are
made at device eviction, so that is when storage writes start; host eviction never waits on
storage: a node being written is pinned and skipped, one whose write failed is simply not stored).
A page counts as stored only once the backend acknowledged it.

Prefetch: `start(rid, tokens)` asks storage (off-thread lookup) how far it holds the prompt; when
that is >= `prefetch_threshold` tokens beyond what the tree can serve, host memory is allocated for
the hit pages only (evicting host, then taking the page-aligned free size) and a job fetches them;
whether the pages and (hybrid) a host state slot can be had is decided before anything is evicted.
While it runs the last host node before the fetched range is pinned for KV. When the job completes
(done, partial, revoked, failed, refused) it is FINALISED at once, whatever its request does: the
fetched pages and state join the tree as host nodes (`RadixTree.insert_host`), and, while the
request still waits, the new end node is pinned for KV and state instead of the anchor.
Admission asks `admit_gate(rid)` whether to wait (policy), and `consume(rid)` takes the pin.

Single-threaded like the tree: every method runs on the controller's thread; worker results are
picked up by `poll()`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from himamba.common.config import CacheConfig
from himamba.services.cache.allocator import PageAllocator, SlotAllocator
from himamba.services.cache.keys import page_keys
from himamba.services.cache.storage.base import StorageHit
from himamba.services.cache.storage.io_workers import (
    JobHandle,
    JobOutcome,
    JobResult,
    ShutdownResult,
    StateCopy,
    StorageIO,
)
from himamba.services.cache.storage.known_keys import KnownKeys
from himamba.services.cache.tree.node import HostPin, TreeNode
from himamba.services.cache.tree.radix_tree import RadixTree

_log = logging.getLogger("himamba.cache.storage")

Phase = Literal["lookup", "fetch", "ready"]
_MID_STATES = 3  # best_effort, hybrid models: intermediate states fetched with a prefix, at most


class PrefetchPlan(NamedTuple):
    """What one prefetch fetches: page keys, tokens and host pages are cut together (`truncate`)."""

    tokens: tuple[int, ...]  # whole pages, root..end of the hit
    keys: list[bytes]  # one per page of `tokens`
    first_page: int  # pages before it are already on host in the tree
    host_pages: list[int]  # one per page in [first_page, len(keys))

    def truncate(self, num_pages: int, page_size: int) -> PrefetchPlan:
        """The plan cut to its first `num_pages` pages (>= first_page)."""
        assert self.first_page <= num_pages <= len(self.keys)
        return PrefetchPlan(
            self.tokens[: num_pages * page_size],
            self.keys[:num_pages],
            self.first_page,
            self.host_pages[: num_pages - self.first_page],
        )


@dataclass(eq=False)
class _Prefetch:
    rid: str
    keys: list[bytes]  # every whole page of the prompt (but the last token)
    tokens: tuple[int, ...]
    first_page: int
    base_len: int  # tokens the tree could already serve when it started
    started: float
    deadline: float  # policy deadline (timeout) or the liveness cap (every policy)
    phase: Phase = "lookup"
    lookup: Future[StorageHit] | None = None
    anchor_pin: HostPin | None = None
    plan: PrefetchPlan | None = None
    host_slot: int | None = None
    handle: JobHandle | None = None
    ready_pin: HostPin | None = None
    fetched: tuple[int, int] = (0, 0)  # token range that came from storage
    mid: list[tuple[int, int]] = field(default_factory=list)  # best_effort: (page count, host slot) of states on the way
    detached: bool = False  # its request no longer waits: finalise only
    revoked: bool = False


class AdmitGate(NamedTuple):
    """Whether a request may be admitted now, and which of its tokens came from storage."""

    wait: bool
    storage_range: tuple[int, int]


@dataclass
class StorageCounters:
    """Monotonic counters the cache service turns into metrics."""

    backup_bytes: int = 0  # KV pages and states together
    backup_state_bytes: int = 0
    backup_ops: int = 0
    prefetch_bytes: int = 0  # KV pages and states together
    prefetch_state_bytes: int = 0
    prefetch_ops: int = 0
    truncations: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)


class StorageTier:
    """See the module docstring."""

    def __init__(
        self,
        cfg: CacheConfig,
        tree: RadixTree,
        host_kv: PageAllocator,
        host_state: SlotAllocator | None,
        io: StorageIO,
        fingerprint: bytes,
    ) -> None:
        self.cfg = cfg
        self.tree = tree
        self.host_kv = host_kv
        self.host_state = host_state
        self.io = io
        self.fingerprint = fingerprint
        self.page_size = cfg.page_size
        self.needs_state = host_state is not None
        self.stored = KnownKeys()  # acknowledged page keys (a belief that saves writes, never read from)
        self.stored_states = KnownKeys()
        self._reconnects_seen = 0
        self._writing: set[bytes] = set()
        self._backups: list[tuple[JobHandle, HostPin, list[bytes], bytes | None]] = []
        self.prefetches: dict[str, _Prefetch] = {}
        self._detached: list[_Prefetch] = []
        self.counters = StorageCounters()

    # ------------------------------------------------------------ keys

    def keys_of(self, node: TreeNode) -> list[bytes]:
        """Page keys of root..node, computed once per node (kept across splits by the tree)."""
        chain: list[TreeNode] = []
        n = node
        while n.parent is not None and n.page_hashes is None:
            chain.append(n)
            n = n.parent
        for x in reversed(chain):
            parent_key = _last_key(x.parent)
            x.page_hashes = page_keys(parent_key, x.key, self.page_size, self.fingerprint)
        out: list[bytes] = []
        n = node
        parts = []
        while n.parent is not None:
            parts.append(n.page_hashes)
            n = n.parent
        for p in reversed(parts):
            out += p  # type: ignore[arg-type]
        return out

    # ------------------------------------------------------------ backup

    def backup(self, node: TreeNode) -> bool:
        """Write the host pages of root..node (and node's host state) that storage lacks."""
        if not node.is_attached or node.host_pages is None or node.parent is None:
            return False
        if self.tree.tainted(node):
            return False  # its path runs through host memory a failed copy never wrote
        self._forget_after_outage()
        keys = self.keys_of(node)
        pages: list[int] = []
        n = node
        parts = []
        while n.parent is not None:
            if n.host_pages is None:
                return False  # host KV is top-closed; a device-only ancestor means nothing to read
            parts.append(n.host_pages)
            n = n.parent
        for p in reversed(parts):
            pages += p
        todo = [i for i, k in enumerate(keys) if k not in self.stored and k not in self._writing]
        state = None
        if node.host_state is not None and keys[-1] not in self.stored_states:
            state = StateCopy(keys[-1], node.host_state)
        if not todo and state is None:
            return False
        pin = self.tree.protect_host(node, kv=True, state=state is not None)
        sel = [keys[i] for i in todo]
        handle = self.io.submit_backup(sel, [pages[i] for i in todo], state, tag=("backup", node.id))
        self._writing.update(sel)
        self._backups.append((handle, pin, sel, state.page_key if state is not None else None))
        return True

    def _forget_after_outage(self) -> None:
        # A store back from an outage may have restarted empty: write everything again (skipped
        # where it still holds the value).
        reconnects = self.io.backend.stats().num_reconnects
        if reconnects != self._reconnects_seen:
            self._reconnects_seen = reconnects
            if len(self.stored) or len(self.stored_states):
                _log.info("storage: the store came back; forgetting which of %d pages it held", len(self.stored))
            self.stored.clear()
            self.stored_states.clear()

    def _finish_backup(self, handle: JobHandle, pin: HostPin, keys: list[bytes], state_key: bytes | None) -> None:
        res: JobResult = handle.future.result()
        self._writing.difference_update(keys)
        self.stored.update(keys[: res.num_pages])  # stored only once the backend acknowledged it
        if res.state_ok and state_key is not None:
            self.stored_states.add(state_key)
        self.tree.release_host(pin)  # exactly what the pin took (KV, and the state iff carried)
        self.counters.backup_bytes += res.num_bytes
        self.counters.backup_state_bytes += res.num_state_bytes
        self.counters.backup_ops += 1
        self.counters.outcomes[f"backup_{res.outcome}"] += 1
        if res.outcome is JobOutcome.FAILED:
            self.counters.errors["backup"] += 1
            _log.warning("storage backup failed after %d pages: %s", res.num_pages, res.error)

    # ------------------------------------------------------------ prefetch

    def start(self, rid: str, tokens: list[int], base_len: int, host_len: int) -> None:
        """Begin a prefetch for `rid`: `base_len` tokens the tree can serve now, `host_len` the
        deepest prefix on host (the fetch starts there)."""
        if rid in self.prefetches:
            return
        ps = self.page_size
        usable = (len(tokens) - 1) // ps * ps  # one token must be computed
        if usable - base_len < max(self.cfg.prefetch_threshold, ps):
            return
        toks = tuple(tokens[:usable])
        host_len = min(host_len, usable)
        anchor_pin = None
        if host_len:
            # The anchor (deepest host node before the fetched range) stays on host from now on,
            # through the asynchronous lookup: a host eviction meanwhile must not void the hit.
            anchor = self.tree.match_prefix_host(toks[:host_len])
            if anchor is None:
                return  # unreachable: the probe just saw it; no prefetch rather than a wrong one
            anchor_pin = self.tree.protect_host(anchor, kv=True)
        keys = page_keys(None, toks, ps, self.fingerprint)
        now = time.monotonic()
        pf = _Prefetch(rid, keys, toks, host_len // ps, base_len, now, now + self.cfg.prefetch_timeout_max_s)
        pf.anchor_pin = anchor_pin
        if self.cfg.hicache_storage_prefetch_policy == "timeout":
            pf.deadline = now + self._timeout_s(usable)
        pf.lookup = self.io.lookup(keys, needs_state=self.needs_state)
        self.prefetches[rid] = pf

    def _timeout_s(self, num_tokens: int) -> float:
        """The timeout policy's wait for a prefetch of `num_tokens`."""
        cfg = self.cfg
        budget = cfg.prefetch_timeout_base_s + cfg.prefetch_timeout_per_ki_token_s * num_tokens / 1024
        return min(budget, cfg.prefetch_timeout_max_s)

    def _useless(self, pf: _Prefetch, hit: StorageHit) -> bool:
        """A miss: storage holds less than the threshold beyond what the tree serves."""
        ps = self.page_size
        return hit.num_pages * ps - pf.base_len < max(self.cfg.prefetch_threshold, ps) or hit.num_pages <= pf.first_page

    def _after_lookup(self, pf: _Prefetch, hit: StorageHit) -> None:
        ps = self.page_size
        thr = max(self.cfg.prefetch_threshold, ps)
        n = hit.num_pages
        if self._useless(pf, hit):
            self._end(pf, "miss")
            return
        # Decide before evicting: what host eviction could free at most (the anchor is pinned, so
        # its path is not counted). Too little for the whole hit: adaptive fallback, cut back to the
        # aligned size that fits, then to a page with a stored state; if that lands below the
        # threshold the host tier is left exactly as it is.
        can_have = self.host_kv.num_free + self.tree.usage().host_pages_evictable
        if n - pf.first_page > can_have:
            n = pf.first_page + can_have
            if self.needs_state:
                n = max((k for k in hit.state_pages if k <= n), default=0)
            if n * ps - pf.base_len < thr or n <= pf.first_page:
                self._end(pf, "no_host_memory")
                return
            self.counters.truncations += 1
        if self.needs_state:
            assert self.host_state is not None
            if self.host_state.num_free + self.tree.usage().host_states_evictable < 1:
                # Every host state is pinned (waiting requests' prefetches, backups, load-backs):
                # refused before any host page is evicted for it.
                self._end(pf, "no_host_slot")
                return
        need = n - pf.first_page
        pages = self.host_kv.alloc(need)
        if pages is None:
            self.tree.evict_host(need - self.host_kv.num_free)
            pages = self.host_kv.alloc(need)
        if pages is None:
            # Unreachable: everything counted evictable is; fail the prefetch, never the loop.
            _log.error("storage prefetch of %s: host eviction freed less than it counted", pf.rid)
            self._end(pf, "no_host_memory")
            return
        slot = None
        if self.needs_state:
            assert self.host_state is not None
            got = self.host_state.alloc(1)
            if got is None:
                self.tree.evict_host_state(1)
                got = self.host_state.alloc(1)
            if got is None:
                # Unreachable: a slot was counted free or evictable before the KV eviction.
                _log.error("storage prefetch of %s: host state eviction freed less than it counted", pf.rid)
                self.host_kv.free(pages)
                self._end(pf, "no_host_slot")
                return
            slot = got[0]
        plan = PrefetchPlan(pf.tokens, pf.keys, pf.first_page, pages).truncate(n, ps)
        pf.plan, pf.host_slot, pf.phase = plan, slot, "fetch"
        state = StateCopy(plan.keys[-1], slot) if slot is not None else None
        if slot is not None and self.cfg.hicache_storage_prefetch_policy == "best_effort":
            pf.mid = self._mid_states(hit, pf.first_page, n)
            if not pf.mid:
                # Nothing to stop at short of the end: admission waits for the whole fetch (see
                # admit_gate), for no longer than the timeout policy would.
                pf.deadline = min(pf.deadline, pf.started + self._timeout_s(len(plan.tokens)))
        pf.handle = self.io.submit_prefetch(
            plan.keys[plan.first_page :], plan.host_pages, state, tag=("prefetch", pf.rid),
            mid_states=[(at - plan.first_page, StateCopy(plan.keys[at - 1], s)) for at, s in pf.mid],
        )

    def _mid_states(self, hit: StorageHit, first_page: int, end: int) -> list[tuple[int, int]]:
        """best_effort on a hybrid model: a request admitted mid-fetch takes what has arrived, and
        that is usable only up to a state. So stored states inside the fetch come along, read as
        soon as their pages are, nearest first (the earliest to arrive), each in a free host slot
        (never evicting for them): (page count, host slot)."""
        assert self.host_state is not None
        at = [k for k in hit.state_pages if first_page < k < end][:_MID_STATES]
        slots = self.host_state.alloc(len(at)) if at else None
        while at and slots is None:
            at.pop()
            slots = self.host_state.alloc(len(at)) if at else None
        return list(zip(at, slots or []))

    def _finalise(self, pf: _Prefetch) -> None:
        assert pf.handle is not None and pf.plan is not None
        res = pf.handle.future.result()
        plan = pf.plan
        self.counters.prefetch_ops += 1
        self.counters.prefetch_bytes += res.num_bytes
        self.counters.prefetch_state_bytes += res.num_state_bytes
        self.counters.outcomes[f"prefetch_{res.outcome}"] += 1
        if res.outcome is JobOutcome.FAILED:
            self.counters.errors["prefetch"] += 1
            _log.warning("storage prefetch of %s failed after %d pages: %s", pf.rid, res.num_pages, res.error)
        if res.outcome is JobOutcome.PARTIAL:
            self._forget_missing(pf, res)
        got = res.num_pages
        state_ok = res.state_ok and got == len(plan.host_pages)
        slot = pf.host_slot if state_ok else None
        if self.needs_state and not state_ok:
            # A hit is atomic: KV without its state at the same position is useless here, so
            # end at the deepest intermediate state that arrived with all its pages, if any.
            arrived = [(at, s) for at, s in pf.mid if at - plan.first_page in res.states_read]
            got, slot = (arrived[-1][0] - plan.first_page, arrived[-1][1]) if arrived else (0, None)
        ps = self.page_size
        end = plan.first_page + got
        self.host_kv.free(plan.host_pages[got:])
        unused = [s for s in (pf.host_slot, *(s for _, s in pf.mid)) if s is not None and s != slot]
        if unused:
            self.host_state.free(unused)  # type: ignore[union-attr]
        pf.mid = []
        node = None
        if got:
            r = self.tree.insert_host(plan.tokens[: end * ps], plan.first_page, plan.host_pages[:got], slot, plan.keys[:end])
            if r.attached:
                node = r.node
                self.stored.update(plan.keys[:end])
                if slot is not None:
                    self.stored_states.add(plan.keys[end - 1])
        elif slot is not None:
            self.host_state.free([slot])  # type: ignore[union-attr]
        if node is not None and not pf.detached:
            pf.ready_pin = self.tree.protect_host(node, kv=True, state=node.host_state is not None)
            pf.fetched = (plan.first_page * ps, end * ps)
        self._release_anchor(pf)
        pf.phase = "ready"

    def _forget_missing(self, pf: _Prefetch, res: JobResult) -> None:
        """A prefetch stopped at a miss: the store lacked a value its lookup reported (evicted, or
        corrupt and dropped by the backend). Whatever this server believed it had stored from there
        on is forgotten, so the next backup of the prefix writes those values again (the store
        skips the ones it still holds); believing them stored would stop that prefix's storage hits
        for good once a corrupt value had been dropped."""
        assert pf.plan is not None
        plan = pf.plan
        self.stored.discard(plan.keys[plan.first_page + res.num_pages :])
        if pf.host_slot is not None and not res.state_ok and res.num_pages == len(plan.host_pages):
            self.stored_states.discard([plan.keys[-1]])
        lost = [
            plan.keys[at - 1]
            for at, _ in pf.mid
            if at - plan.first_page <= res.num_pages and at - plan.first_page not in res.states_read
        ]
        self.stored_states.discard(lost)

    def _release_anchor(self, pf: _Prefetch) -> None:
        if pf.anchor_pin is not None:
            self.tree.release_host(pf.anchor_pin)
            pf.anchor_pin = None

    def _end(self, pf: _Prefetch, why: str) -> None:
        self._release_anchor(pf)
        self.counters.outcomes[f"prefetch_{why}"] += 1
        pf.phase = "ready"

    # ------------------------------------------------------------ admission

    def admit_gate(self, rid: str) -> AdmitGate:
        """Apply the prefetch policy for a request about to be admitted."""
        self.poll()
        pf = self.prefetches.get(rid)
        if pf is None or pf.phase == "ready":
            return AdmitGate(False, pf.fetched if pf else (0, 0))
        policy = self.cfg.hicache_storage_prefetch_policy
        if time.monotonic() >= pf.deadline or (policy == "best_effort" and pf.phase == "lookup"):
            self._give_up(pf)  # no prefetch stalls a request past its deadline
            return AdmitGate(False, (0, 0))
        if policy == "best_effort" and not pf.revoked and pf.handle is not None:
            if self.needs_state and not pf.mid:
                # A hybrid fetch with no stored state before its end is one atomic unit: revoking
                # it would discard every page that arrived. Wait for it (deadline set above).
                return AdmitGate(True, (0, 0))
            # Take what has arrived: the job stops at its next batch boundary and is finalised.
            pf.revoked = True
            pf.handle.revoke()
        return AdmitGate(True, (0, 0))

    def waits(self, rid: str) -> bool:
        """Whether `admit_gate(rid)` would still say wait (read-only: changes nothing)."""
        pf = self.prefetches.get(rid)
        if pf is None or pf.phase == "ready" or time.monotonic() >= pf.deadline:
            return False
        return not (self.cfg.hicache_storage_prefetch_policy == "best_effort" and pf.phase == "lookup")

    def _give_up(self, pf: _Prefetch) -> None:
        """The request goes on without the rest of its prefetch; the job is finalised later."""
        if pf.handle is not None:
            pf.handle.revoke()
        pf.detached = True
        self.prefetches.pop(pf.rid, None)
        if pf.phase != "ready":
            self._detached.append(pf)

    def consume(self, rid: str) -> None:
        """The request was admitted (or cancelled): drop what its prefetch still pinned."""
        pf = self.prefetches.pop(rid, None)
        if pf is None:
            return
        if pf.phase != "ready":
            self._give_up(pf)
            return
        if pf.ready_pin is not None:
            self.tree.release_host(pf.ready_pin)
            pf.ready_pin = None

    def cancel(self, rid: str) -> None:
        """CancelPrefetch: revoke; finalisation still inserts what arrived."""
        self.consume(rid)

    def in_flight_host(self) -> tuple[list[int], list[int]]:
        """Host pages and slots owned by running prefetch jobs (not the tree's yet)."""
        pages: list[int] = []
        slots: list[int] = []
        for pf in [*self.prefetches.values(), *self._detached]:
            if pf.phase == "fetch" and pf.plan is not None:
                pages += pf.plan.host_pages
                if pf.host_slot is not None:
                    slots.append(pf.host_slot)
                slots += [s for _, s in pf.mid]
        return pages, slots

    # ------------------------------------------------------------ progress

    @property
    def busy(self) -> bool:
        return bool(self._backups or self._detached or any(p.phase != "ready" for p in self.prefetches.values()))

    def poll(self) -> None:
        """Pick up completed lookups and jobs; enforce the liveness cap."""
        if self._backups:
            left = []
            for item in self._backups:
                if item[0].future.done():
                    self._finish_backup(*item)
                else:
                    left.append(item)
            self._backups = left
        now = time.monotonic()
        # Lookups that ended: misses (and given-up ones) first, so the anchors they pinned are
        # released before a hit decides what host eviction could free.
        ended = [
            p
            for p in [*self.prefetches.values(), *self._detached]
            if p.phase == "lookup" and p.lookup is not None and p.lookup.done()
        ]
        hits = []
        for pf in ended:
            if pf.detached:
                self._release_anchor(pf)
                pf.phase = "ready"
            elif self._useless(pf, pf.lookup.result()):  # type: ignore[union-attr]
                self._end(pf, "miss")
            else:
                hits.append(pf)
        for pf in hits:
            self._after_lookup(pf, pf.lookup.result())  # type: ignore[union-attr]
        for pf in [*self.prefetches.values(), *self._detached]:
            if pf.phase == "fetch" and pf.handle is not None:
                if pf.handle.future.done():
                    self._finalise(pf)
                elif now >= pf.deadline and not pf.revoked:
                    pf.revoked = True
                    pf.handle.revoke()
        self._detached = [p for p in self._detached if p.phase != "ready"]

    def close(self, *, drain: bool = False, timeout_s: float = 1.5) -> ShutdownResult:
        """Stop the I/O workers (queued jobs run to the end with `drain`, else are cancelled) and
        finalise everything."""
        result = self.io.close(drain=drain, timeout_s=timeout_s)
        for pf in list(self.prefetches.values()):
            self._give_up(pf)
        self.poll()
        return result


def _last_key(node: TreeNode | None) -> bytes | None:
    if node is None or node.parent is None:
        return None  # the root: a sequence starts here
    assert node.page_hashes, f"node {node.id} has no page keys"
    return node.page_hashes[-1]
