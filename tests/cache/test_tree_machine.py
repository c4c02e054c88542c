"""Hypothesis state machine over the radix tree, its four allocators and a simulated memory.

Random requests (match, lock, optional load-back, allocate with eviction, insert, unlock or abort)
interleave with every eviction, backup / load-back start and acknowledgement, extra locks and host
protections, and the storage tier's steps against an in-memory store (backup host -> storage under
a host pin, prefetch start with an anchor pin and host allocation, arrival through `insert_host`,
failure), on tiny pools with a 3-token alphabet so that prefixes collide and nodes split.

The machine keeps a content oracle: every device/host page and state slot holds the prefix it was
computed for, copies happen when the order is issued (the worker executes orders in issue order),
and a request writes its own pages when it computes. After every step `check_invariants()` runs
with the request-owned pages and slots as external, and every page / state the tree points at must
hold exactly its node's prefix; a lock or a host protection that fails lets a page be reused and
overwritten, which the oracle catches.

HIMAMBA_HYPOTHESIS_EXAMPLES (default 60) sets the number of runs per page size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from himamba.services.cache.allocator import PageAllocator, SlotAllocator
from himamba.services.cache.tree.node import HostPin, LockReceipt, TreeNode
from himamba.services.cache.tree.orders import BackupOp, LoadOp
from himamba.services.cache.tree.radix_tree import RadixTree

EXAMPLES = int(os.environ.get("HIMAMBA_HYPOTHESIS_EXAMPLES", "60"))
Prefix = tuple[int, ...]


@dataclass
class Request:
    tokens: Prefix
    cached_len: int
    prefix_pages: list[int]
    receipt: LockReceipt
    own_pages: list[int] = field(default_factory=list)
    locked_state: int | None = None  # the device state slot the request copies from while locked
    slot: int | None = None
    computed: bool = False


def path_tokens(node: TreeNode) -> Prefix:
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return tuple(t for part in reversed(parts) for t in part)


class TreeMachine(RuleBasedStateMachine):
    page_size = 1

    def __init__(self) -> None:
        super().__init__()
        self.requests: dict[int, Request] = {}
        self.next_rid = 0
        self.backups: list[tuple[BackupOp, list[tuple[int, Prefix]], list[tuple[int, Prefix]]]] = []
        self.loads: list[tuple[LoadOp, list[tuple[int, Prefix]], list[tuple[int, Prefix]]]] = []
        self.extra_locks: list[LockReceipt] = []
        self.host_protections: list[HostPin] = []
        self.dev_mem: dict[int, Prefix] = {}
        self.host_mem: dict[int, Prefix] = {}
        self.dev_state_mem: dict[int, Prefix] = {}
        self.host_state_mem: dict[int, Prefix] = {}
        # The fake store: page prefix -> content, state prefix -> content.
        self.store_kv: dict[Prefix, Prefix] = {}
        self.store_state: dict[Prefix, Prefix] = {}
        self.store_backups: list[tuple[HostPin, list[tuple[int, Prefix]], tuple[int, Prefix] | None]] = []
        self.prefetches: list[tuple[Prefix, int, HostPin | None, list[int], int | None]] = []

    @initialize(
        num_pages=st.integers(8, 24),
        num_slots=st.integers(3, 6),
        host=st.sampled_from(["none", "kv", "both"]),
        host_factor=st.sampled_from([0.25, 0.5, 1, 2]),  # small pools: mirrors fill the host
        write_policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
        eviction_policy=st.sampled_from(["lru", "scan_resistant"]),
    )
    def setup(self, num_pages, num_slots, host, host_factor, write_policy, eviction_policy):
        self.kv = PageAllocator(num_pages)
        self.st = SlotAllocator(num_slots)
        self.hkv = PageAllocator(max(1, int(num_pages * host_factor))) if host != "none" else None
        self.hst = SlotAllocator(max(1, int(num_slots * host_factor))) if host == "both" else None
        self.tree = RadixTree(
            self.page_size, self.kv, self.st, self.hkv, self.hst, write_policy, 2, eviction_policy
        )

    # ------------------------------------------------------------------ oracle helpers

    def issue_backup(self, op: BackupOp) -> None:
        for d, h in zip(op.device_pages, op.host_pages, strict=True):
            self.host_mem[h] = self.dev_mem[d]
        for d, h in zip(op.device_states, op.host_states, strict=True):
            self.host_state_mem[h] = self.dev_state_mem[d]
        pages = [(h, self.host_mem[h]) for h in op.host_pages]
        states = [(h, self.host_state_mem[h]) for h in op.host_states]
        self.backups.append((op, pages, states))

    def issue_backups(self, ops: list[BackupOp]) -> None:
        for op in ops:
            self.issue_backup(op)

    def issue_load(self, op: LoadOp) -> None:
        self.issue_backups(op.backups)  # sent before the load: they may free pages the load reuses
        for h, d in zip(op.host_pages, op.device_pages, strict=True):
            self.dev_mem[d] = self.host_mem[h]
        for h, d in zip(op.host_states, op.device_states, strict=True):
            self.dev_state_mem[d] = self.host_state_mem[h]
        pages = [(h, self.host_mem[h]) for h in op.host_pages]
        states = [(h, self.host_state_mem[h]) for h in op.host_states]
        self.loads.append((op, pages, states))

    def all_nodes(self) -> list[TreeNode]:
        out, stack = [], [self.tree.root]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        out.sort(key=lambda n: n.id)
        return out

    def alloc_pages(self, n: int) -> list[int] | None:
        pages = self.kv.alloc(n)
        if pages is None:
            res = self.tree.evict(n - self.kv.num_free)
            self.issue_backups(res.backups)
            pages = self.kv.alloc(n)
        return pages

    def alloc_slot(self) -> int | None:
        got = self.st.alloc(1)
        if got is None:
            res = self.tree.evict_state(1)
            self.issue_backups(res.backups)
            got = self.st.alloc(1)
        return got[0] if got else None

    # ------------------------------------------------------------------ requests

    def draw_tokens(self, data, extend: bool) -> Prefix:
        """A prompt of 1-7 pages; `extend` starts it with the path of an existing node (a hit or a split)."""
        ps = self.page_size
        base: Prefix = ()
        if extend:
            nodes = self.all_nodes()
            with_state = [n for n in nodes if n.device_state is not None or n.host_state is not None]
            node = data.draw(st.sampled_from(with_state or nodes))
            base = path_tokens(node)
            if data.draw(st.booleans()):  # cut inside the path: splits and branch points
                base = base[: data.draw(st.integers(0, len(base) // ps)) * ps]
            base += tuple(data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=ps)))
        n = data.draw(st.integers(max(1, -(-len(base) // ps)), max(1, -(-len(base) // ps)) + 3))
        rest = data.draw(st.lists(st.integers(0, 2), min_size=n * ps - len(base), max_size=n * ps - len(base)))
        return (base + tuple(rest))[: n * ps]

    def begin(self, tokens: Prefix, load: bool) -> Request:
        ps = self.page_size
        tree = self.tree
        m = tree.match_prefix(tokens[:-1])
        self.issue_backups(m.backups)
        assert m.cached_len % ps == 0 and m.kv_match_len % ps == 0
        assert m.cached_len <= m.kv_match_len <= len(tokens) - 1
        assert m.device_len + m.host_len == m.cached_len
        assert len(m.device_pages) * ps == m.device_len
        assert path_tokens(m.node) == tokens[: m.cached_len]
        assert path_tokens(m.device_node) == tokens[: m.device_cached_len]
        assert m.device_cached_len <= m.device_len
        for i, p in enumerate(m.device_pages):
            assert self.dev_mem[p] == tokens[: (i + 1) * ps]
        if m.state_tier == "device":
            assert self.dev_state_mem[m.node.device_state] == tokens[: m.cached_len]
            assert m.host_len == 0
        elif m.state_tier == "host":
            assert self.host_state_mem[m.node.host_state] == tokens[: m.cached_len]
        else:
            assert m.cached_len == 0 and m.node is tree.root
        if m.device_node is not tree.root:
            assert self.dev_state_mem[m.device_node.device_state] == tokens[: m.device_cached_len]

        receipt = tree.lock(m.node)
        cached, prefix = m.device_cached_len, m.device_pages[: m.device_cached_len // ps]
        if m.state_tier == "device":
            cached, prefix = m.cached_len, m.device_pages
        elif load and m.state_tier == "host":
            op = tree.load_back(m.node)
            if op is not None:
                self.issue_load(op)
                cached, prefix = m.cached_len, m.device_pages + op.device_pages
        target = m.node if cached == m.cached_len else m.device_node
        old, receipt = receipt, tree.lock(target)
        tree.unlock(old)
        for i, p in enumerate(prefix):
            assert self.dev_mem[p] == tokens[: (i + 1) * ps]
        if cached:
            assert receipt.state_node is target and target.device_state is not None
        locked_state = target.device_state if receipt.state_node is not None else None
        return Request(tokens, cached, prefix, receipt, locked_state=locked_state)

    def compute_request(self, req: Request) -> None:
        ps = self.page_size
        n_whole = len(req.tokens) // ps
        start = req.cached_len // ps
        pages = self.alloc_pages(n_whole - start)
        if pages is None:
            return
        req.own_pages = pages
        for i, p in enumerate(pages):
            self.dev_mem[p] = req.tokens[: (start + i + 1) * ps]
        req.slot = self.alloc_slot()
        if req.slot is not None:
            self.dev_state_mem[req.slot] = req.tokens[: n_whole * ps]
        req.computed = True

    def finish_request(self, req: Request, with_state: bool, declare_lock: bool) -> None:
        tree = self.tree
        ps = self.page_size
        if req.computed:
            n_whole = len(req.tokens) // ps
            slot = req.slot if with_state else None
            if slot is None and req.slot is not None:
                self.st.free([req.slot])
            ins = tree.insert(
                req.tokens[: n_whole * ps],
                req.prefix_pages + req.own_pages,
                slot,
                req.cached_len if declare_lock else 0,
            )
            self.issue_backups(ins.backups)
            assert path_tokens(ins.node) == req.tokens[: n_whole * ps]
            assert len(ins.pages) == n_whole
            assert ins.pages[: len(req.prefix_pages)] == req.prefix_pages
            assert ins.num_dup_freed == sum(a != b for a, b in zip(ins.pages, req.prefix_pages + req.own_pages))
            for i, p in enumerate(ins.pages):
                assert self.dev_mem[p] == req.tokens[: (i + 1) * ps]
            if slot is not None:
                assert ins.node.device_state is not None
                assert ins.state_used == (ins.node.device_state == slot)
        elif req.slot is not None:
            self.st.free([req.slot])
        tree.unlock(req.receipt)

    @rule(data=st.data(), extend=st.booleans(), load=st.booleans(), with_state=st.booleans(), declare_lock=st.booleans())
    def serve(self, data, extend, load, with_state, declare_lock):
        """A whole request at once: match, lock, maybe load back, compute, insert, unlock."""
        req = self.begin(self.draw_tokens(data, extend), load)
        self.compute_request(req)
        self.finish_request(req, with_state, declare_lock)

    @rule(data=st.data(), extend=st.booleans(), load=st.booleans())
    def start_request(self, data, extend, load):
        self.requests[self.next_rid] = self.begin(self.draw_tokens(data, extend), load)
        self.next_rid += 1

    def _pick(self, data) -> tuple[int, Request]:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        return rid, self.requests[rid]

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def compute(self, data):
        _, req = self._pick(data)
        if not req.computed:
            self.compute_request(req)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), with_state=st.booleans(), declare_lock=st.booleans(), abort=st.booleans())
    def finish(self, data, with_state, declare_lock, abort):
        rid, req = self._pick(data)
        del self.requests[rid]
        if abort:
            if req.own_pages:
                self.kv.free(req.own_pages)
            if req.slot is not None:
                self.st.free([req.slot])
            self.tree.unlock(req.receipt)
        else:
            self.finish_request(req, with_state, declare_lock)

    # ------------------------------------------------------------------ eviction

    @rule(kind=st.sampled_from(["kv", "state", "host_kv", "host_state"]), n=st.integers(0, 8) | st.just(10**6))
    def evict(self, kind, n):
        tree = self.tree
        pool = {"kv": self.kv, "state": self.st, "host_kv": self.hkv, "host_state": self.hst}[kind]
        before = pool.num_free if pool is not None else 0
        res = {"kv": tree.evict, "state": tree.evict_state, "host_kv": tree.evict_host, "host_state": tree.evict_host_state}[
            kind
        ](n)
        self.issue_backups(res.backups)
        freed = {"kv": res.num_pages, "state": res.num_states, "host_kv": res.num_host_pages, "host_state": res.num_host_states}[
            kind
        ]
        if pool is not None:
            assert pool.num_free == before + freed
        if kind in ("host_kv", "host_state"):
            assert not res.backups
        if freed < n:  # it stopped early only because nothing more was evictable
            if kind == "kv":
                assert tree.usage().device_pages_evictable == 0
            elif kind == "state":
                assert tree.usage().device_states_evictable == 0
            elif kind == "host_kv":  # host-only leaves and mirrors of device nodes are both gone
                assert len(tree._host_leaves) == 0 and len(tree._host_mirrors) == 0
                assert tree.usage().host_pages_evictable == 0
            else:
                assert tree.usage().host_states_evictable == 0

    # ------------------------------------------------------------------ transfers

    @rule(data=st.data())
    def backup(self, data):
        nodes = self.all_nodes()
        wanted = [n for n in nodes if n.device_pages is not None and (n.host_pages is None or n.host_state is None)]
        node = data.draw(st.sampled_from(wanted or nodes))
        op = self.tree.backup(node)
        if op is not None:
            assert node.host_pages is not None
            self.issue_backup(op)

    def _finish_transfer(self, pages, states) -> None:
        for h, content in pages:
            assert self.hkv is not None and not self.hkv.is_free(h)
            assert self.host_mem[h] == content, f"host page {h} was overwritten while its transfer was pending"
        for h, content in states:
            assert self.hst is not None and not self.hst.is_free(h)
            assert self.host_state_mem[h] == content, f"host slot {h} was overwritten while pending"

    @rule(data=st.data())
    def load_back(self, data):
        nodes = self.all_nodes()
        wanted = [n for n in nodes if n.device_pages is None or (n.device_state is None and n.host_state is not None)]
        node = data.draw(st.sampled_from(wanted or nodes))
        op = self.tree.load_back(node)
        if op is not None:
            assert node.device_pages is not None
            self.issue_load(op)

    @precondition(lambda self: self.backups or self.loads)
    @rule(data=st.data())
    def ack(self, data):
        """The worker acknowledges one pending transfer (in any order)."""
        i = data.draw(st.integers(0, len(self.backups) + len(self.loads) - 1))
        if i < len(self.backups):
            op, pages, states = self.backups.pop(i)
            self._finish_transfer(pages, states)
            self.tree.backup_done(op)
        else:
            lop, pages, states = self.loads.pop(i - len(self.backups))
            self._finish_transfer(pages, states)
            self.tree.load_back_done(lop)

    @precondition(lambda self: self.backups or self.loads)
    @rule()
    def ack_all(self):
        """The worker catches up: every pending transfer is acknowledged, so host KV is unpinned
        (write_through then leaves the host pool full of evictable mirrors of device nodes)."""
        for op, pages, states in self.backups:
            self._finish_transfer(pages, states)
            self.tree.backup_done(op)
        for lop, pages, states in self.loads:
            self._finish_transfer(pages, states)
            self.tree.load_back_done(lop)
        self.backups.clear()
        self.loads.clear()

    # ------------------------------------------------------------------ extra locks and protections

    @rule(data=st.data(), release=st.booleans())
    def extra_lock(self, data, release):
        if release and self.extra_locks:
            i = data.draw(st.integers(0, len(self.extra_locks) - 1))
            self.tree.unlock(self.extra_locks.pop(i))
        else:
            nodes = self.all_nodes()
            stateless = [n for n in nodes if n.device_pages is not None and n.device_state is None]
            node = data.draw(st.sampled_from(stateless if stateless and data.draw(st.booleans()) else nodes))
            cost, before = self.tree.lock_cost(node), self.tree.usage()
            assert self.tree.usage() == before, "lock_cost changed the tree"
            self.extra_locks.append(self.tree.lock(node))
            after = self.tree.usage()
            got = (after.device_pages_protected - before.device_pages_protected,
                   after.device_states_protected - before.device_states_protected)  # fmt: skip
            assert got == tuple(cost), f"lock_cost said {cost}, the lock protected {got}"

    @rule(data=st.data(), kv=st.booleans(), state=st.booleans(), release=st.booleans())
    def host_protection(self, data, kv, state, release):
        """A storage-style pin of host KV and/or host state, taken or released."""
        if release and self.host_protections:
            i = data.draw(st.integers(0, len(self.host_protections) - 1))
            self.tree.release_host(self.host_protections.pop(i))
            return
        candidates = [
            n
            for n in self.all_nodes()
            if n is not self.tree.root
            and (kv or state)
            and (not kv or n.host_pages is not None)
            and (not state or n.host_state is not None)
        ]
        if candidates:
            node = data.draw(st.sampled_from(candidates))
            self.host_protections.append(self.tree.protect_host(node, kv=kv, state=state))

    # ------------------------------------------------------------------ storage tier

    @precondition(lambda self: self.hkv is not None)
    @rule(data=st.data(), with_state=st.booleans(), ack_now=st.booleans())
    def storage_backup(self, data, with_state, ack_now):
        """Start a host -> storage backup of root..node (its host copy is complete: copies happen at issue)."""
        nodes = [n for n in self.all_nodes() if n is not self.tree.root and n.host_pages is not None]
        if not nodes:
            # Make a host copy first (the oracle copies at issue, as the worker executes in order).
            dev = [n for n in self.all_nodes() if n is not self.tree.root and n.device_pages is not None]
            op = self.tree.backup(data.draw(st.sampled_from(dev))) if dev else None
            if op is None:
                return
            self.issue_backup(op)
            nodes = [op.node]
        node = data.draw(st.sampled_from(nodes))
        carry = with_state and node.host_state is not None
        pin = self.tree.protect_host(node, kv=True, state=carry)
        full = path_tokens(node)
        pages: list[tuple[int, Prefix]] = []
        n, hp = node, []
        while n is not self.tree.root:
            hp = list(n.host_pages) + hp  # type: ignore[arg-type]
            n = n.parent  # type: ignore[assignment]
        ps = self.page_size
        for i, h in enumerate(hp):
            assert self.host_mem[h] == full[: (i + 1) * ps]
            pages.append((h, self.host_mem[h]))
        state = (node.host_state, self.host_state_mem[node.host_state]) if carry else None  # type: ignore[index]
        self.store_backups.append((pin, pages, state))
        if ack_now:
            self._storage_ack(len(self.store_backups) - 1, fail=False)

    @precondition(lambda self: self.store_backups)
    @rule(data=st.data(), fail=st.booleans())
    def storage_backup_done(self, data, fail):
        """The store acknowledges (or refuses) a backup; the pin is released either way."""
        self._storage_ack(data.draw(st.integers(0, len(self.store_backups) - 1)), fail)

    def _storage_ack(self, i: int, fail: bool) -> None:
        pin, pages, state = self.store_backups.pop(i)
        for h, content in pages:
            assert self.host_mem[h] == content, f"host page {h} changed while storage read it"
            if not fail:
                self.store_kv[content] = content
        if state is not None:
            assert self.host_state_mem[state[0]] == state[1], "host state changed while storage read it"
            if not fail:
                self.store_state[state[1]] = state[1]
        self.tree.release_host(pin)

    @precondition(lambda self: self.hkv is not None and self.store_kv)
    @rule(data=st.data())
    def prefetch_start(self, data):
        """A prompt whose stored prefix is longer than the tree's host prefix: pin the anchor, allocate."""
        ps = self.page_size
        targets = [p for p in self.store_kv if all(p[: (i + 1) * ps] in self.store_kv for i in range(len(p) // ps))]
        if not targets:
            return
        prefix = data.draw(st.sampled_from(sorted(targets)))
        need_state = self.hst is not None and prefix in self.store_state
        host_len = self.tree.probe(prefix).host_len
        if host_len >= len(prefix):
            # Host pressure pushed it out meanwhile (the case prefetch exists for).
            k = data.draw(st.sampled_from([1, 4, 10**6]))
            self.issue_backups(self.tree.evict(k).backups)
            self.tree.evict_host(k)
            host_len = self.tree.probe(prefix).host_len
            if host_len >= len(prefix):
                return
        anchor = None
        if host_len:
            node = self.tree.match_prefix_host(prefix[:host_len])
            assert node is not None
            anchor = self.tree.protect_host(node, kv=True)
        first = host_len // ps
        need = len(prefix) // ps - first
        pages = self.hkv.alloc(need)  # type: ignore[union-attr]
        if pages is None:
            self.tree.evict_host(need - self.hkv.num_free)  # type: ignore[union-attr]
            pages = self.hkv.alloc(need)  # type: ignore[union-attr]
        slot = None
        if pages is not None and need_state:
            got = self.hst.alloc(1)  # type: ignore[union-attr]
            if got is None:
                self.tree.evict_host_state(1)
                got = self.hst.alloc(1)  # type: ignore[union-attr]
            if got is None:
                self.hkv.free(pages)  # type: ignore[union-attr]
                pages = None
            else:
                slot = got[0]
        if pages is None:
            if anchor is not None:
                self.tree.release_host(anchor)  # gave up cleanly
            return
        for h in pages:
            self.host_mem[h] = ("garbage",)  # type: ignore[assignment]  # not arrived yet
        self.prefetches.append((prefix, first, anchor, pages, slot))

    @precondition(lambda self: self.prefetches)
    @rule(data=st.data(), outcome=st.sampled_from(["arrive", "partial", "fail"]))
    def prefetch_finish(self, data, outcome):
        """A prefetch job completes: all pages (and the state), a leading part without the state, or nothing."""
        prefix, first, anchor, pages, slot = self.prefetches.pop(data.draw(st.integers(0, len(self.prefetches) - 1)))
        ps = self.page_size
        got = len(pages) if outcome == "arrive" else 0
        if outcome == "partial" and slot is None:
            got = data.draw(st.integers(0, len(pages)))
        for i in range(got):
            self.host_mem[pages[i]] = self.store_kv[prefix[: (first + i + 1) * ps]]
        use_slot = slot if got == len(pages) else None
        if use_slot is not None:
            self.host_state_mem[use_slot] = self.store_state[prefix]
        elif slot is not None:
            self.hst.free([slot])  # type: ignore[union-attr]
        self.hkv.free(pages[got:])  # type: ignore[union-attr]
        if got:
            end = (first + got) * ps
            res = self.tree.insert_host(prefix[:end], first, pages[:got], use_slot)
            assert res.attached, "the anchor was pinned: the prefix before the fetched pages stays on host"
            assert path_tokens(res.node) == prefix[:end]
            if use_slot is not None:
                assert res.node.host_state is not None
        if anchor is not None:
            self.tree.release_host(anchor)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def tree_invariants(self):
        ext_pages = [p for r in self.requests.values() for p in r.own_pages]
        ext_slots = [r.slot for r in self.requests.values() if r.slot is not None]
        ext_host = [h for pf in self.prefetches for h in pf[3]]
        ext_host_slots = [pf[4] for pf in self.prefetches if pf[4] is not None]
        self.tree.check_invariants(ext_pages, ext_slots, ext_host, ext_host_slots)

    @invariant()
    def contents_match_the_tree(self):
        ps = self.page_size
        for node in self.all_nodes():
            if node is self.tree.root:
                continue
            full = path_tokens(node)
            start = len(full) - len(node.key)
            for i, p in enumerate(node.device_pages or ()):
                assert self.dev_mem[p] == full[: start + (i + 1) * ps], f"device page {p} of node {node.id}"
            for i, p in enumerate(node.host_pages or ()):
                assert self.host_mem[p] == full[: start + (i + 1) * ps], f"host page {p} of node {node.id}"
            if node.device_state is not None:
                assert self.dev_state_mem[node.device_state] == full, f"device state of node {node.id}"
            if node.host_state is not None:
                assert self.host_state_mem[node.host_state] == full, f"host state of node {node.id}"

    @invariant()
    def running_requests_keep_their_prefix(self):
        for req in self.requests.values():
            assert req.receipt.node.is_attached
            for i, p in enumerate(req.prefix_pages):
                assert not self.kv.is_free(p)
                assert self.dev_mem[p] == req.tokens[: (i + 1) * self.page_size]
            if req.locked_state is not None:
                assert req.receipt.node.device_state == req.locked_state, "a locked state was evicted"
                assert self.dev_state_mem[req.locked_state] == req.tokens[: req.cached_len]

    def teardown(self):
        # Draining everything must return every pool to full.
        if not hasattr(self, "tree"):
            return
        for op, pages, states in self.backups:
            self.tree.backup_done(op)
        for op, pages, states in self.loads:
            self.tree.load_back_done(op)
        for r in self.extra_locks:
            self.tree.unlock(r)
        for pin in self.host_protections:
            self.tree.release_host(pin)
        for pin, _, _ in self.store_backups:
            self.tree.release_host(pin)
        for _, _, anchor, pages, slot in self.prefetches:
            self.hkv.free(pages)  # type: ignore[union-attr]
            if slot is not None:
                self.hst.free([slot])  # type: ignore[union-attr]
            if anchor is not None:
                self.tree.release_host(anchor)
        for req in self.requests.values():
            if req.own_pages:
                self.kv.free(req.own_pages)
            if req.slot is not None:
                self.st.free([req.slot])
            self.tree.unlock(req.receipt)
        tree = self.tree
        assert tree.usage().device_pages_protected == 0 and tree.usage().device_states_protected == 0
        assert tree.usage().host_pages_protected == 0 and tree.usage().host_states_protected == 0
        for _ in range(4):  # write_back demotes (issuing backups) before host eviction can delete
            for res in (tree.evict(10**6), tree.evict_state(10**6), tree.evict_host(10**6), tree.evict_host_state(10**6)):
                for op in res.backups:
                    tree.backup_done(op)
        tree.check_invariants()
        assert self.kv.num_free == self.kv.capacity and self.st.num_free == self.st.capacity
        if self.hkv is not None:
            assert self.hkv.num_free == self.hkv.capacity
        if self.hst is not None:
            assert self.hst.num_free == self.hst.capacity
        assert tree.usage().nodes == 1


class TreeMachinePage4(TreeMachine):
    page_size = 4


_settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=50,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

TestTreeMachinePage1 = TreeMachine.TestCase
TestTreeMachinePage1.settings = _settings
TestTreeMachinePage4 = TreeMachinePage4.TestCase
TestTreeMachinePage4.settings = _settings
