"""The tiered radix tree: token-page prefixes -> device KV, device state, host KV, host state.

A node is a run of whole pages (node.py: the node, its counts and the receipts that record them).
Its KV may be on device, on host or both; a state may sit only at a node's END.

Structural invariants (checked by `check_invariants`, in invariants.py):

    root ─ A ─ B ─ C          device KV is top-closed: a node on device has its parent on device,
             └ D              host KV is top-closed too, and every non-root node holds KV on device
                              or on host (a node holding neither is deleted).
    state on device => KV on device;  state on host => KV on host.
    lock_ref >= mamba_lock_ref;  lock_ref > 0 => on device;  parent.lock_ref >= sum(device children).
    host_ref > 0 => host KV;  host_mamba_ref > 0 => host state.

Eviction order. Device KV is evicted leaf by leaf (a leaf whose children are all off device counts),
states over all nodes. Host KV goes by deleting host-only leaves first; once none is left, host
eviction drops "mirrors", the host copies of device-resident nodes with no child on host, deepest
first, and leaves the nodes on device (under write_through the mirrors would otherwise fill the host
pool and refuse every later backup and prefetch: sglang #33862); a later backup copies them again.
The queues in eviction.py decide the order within each kind. KV recency is refreshed along
the consumed path, state recency only on the consumed state (sglang #31643). A state consumed once
and then followed by a deeper state on the same chain (the next turn of a conversation) expires
at once: it is dead weight that the touch would otherwise keep over other conversations' states.

Transfers. The worker executes copy orders in issue order, before any later forward, so device
pages named in an order may be freed and reused at once; host pages (and host slots) a transfer
writes or reads stay pinned by host_ref / host_mamba_ref until `backup_done` / `load_back_done`,
because storage threads touch host memory outside that order.

Failed transfers. An order that fails (`backup_failed` / `load_back_failed`) releases its pins like
a done one and rolls back what it assigned: the copies on the tier it should have written are
dropped, with everything hanging below them on that tier (their path runs through memory that was
never written). What a lock or pin still holds is rolled back later (`retry_rollbacks`); until
then the node is TAINTED: matches, probes and host matches stop above it, and `tainted(node)` tells
the storage tier not to read it.

Ownership. Everything handed to `insert` (pages and the state slot) belongs to the tree afterwards:
duplicates and an unused state slot are freed by the tree into their allocators.

Single-threaded: the cache controller calls every method from one thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from himamba.services.cache.allocator import PageAllocator, SlotAllocator
from himamba.services.cache.eviction import EVICTION_POLICIES, EXPIRED, EvictionQueue, make_queue
from himamba.services.cache.tree.invariants import check_tree
from himamba.services.cache.tree.node import HostPin, LockReceipt, TreeNode
from himamba.services.cache.tree.orders import BackupOp, LoadOp
from himamba.services.cache.tree.results import (
    EvictResult,
    HostInsertResult,
    InsertResult,
    LockCost,
    MatchResult,
    ProbeResult,
    StateTier,
    TreeUsage,
)

WritePolicy = Literal["write_back", "write_through", "write_through_selective"]
WRITE_POLICIES: tuple[str, ...] = ("write_back", "write_through", "write_through_selective")


@dataclass(eq=False, slots=True)
class _Taint:
    """Copies on `tier` that a failed order never wrote: the whole subtree of `node` on that tier
    (`subtree`), or only node's state there (a state-only order)."""

    node: TreeNode
    tier: Literal["device", "host"]
    subtree: bool


class _Freed:
    """Backup orders issued during one eviction call; the freed amounts come from the counters."""

    __slots__ = ("backups", "_start")

    def __init__(self, tree: RadixTree) -> None:
        self.backups: list[BackupOp] = []
        self._start = (tree._dev_pages_used, tree._dev_states_used, tree._host_pages_used, tree._host_states_used)

    def result(self, tree: RadixTree) -> EvictResult:
        # Counter differences also cover what nested calls freed (write_back backups evict host,
        # whose cascade may delete dead device nodes).
        p, s, hp, hs = self._start
        return EvictResult(
            p - tree._dev_pages_used,
            s - tree._dev_states_used,
            hp - tree._host_pages_used,
            hs - tree._host_states_used,
            self.backups,
        )


class RadixTree:
    """Prefix cache over four pools. Every public method keeps the invariants in the module docstring.

    host_kv None means no host tier; host_state None with a host_kv means a KV-only host tier.
    """

    def __init__(
        self,
        page_size: int,
        device_kv: PageAllocator,
        device_state: SlotAllocator,
        host_kv: PageAllocator | None = None,
        host_state: SlotAllocator | None = None,
        write_policy: WritePolicy = "write_through",
        selective_threshold: int = 2,
        eviction_policy: str = "lru",
        *,
        seed: int = 0,
    ) -> None:
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        if eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be one of {EVICTION_POLICIES}, got {eviction_policy!r}")
        if selective_threshold < 1:
            raise ValueError(f"selective_threshold must be >= 1, got {selective_threshold}")
        if host_state is not None and host_kv is None:
            raise ValueError("host_state needs host_kv: a host state is stored with its host KV")
        self.page_size = page_size
        self.write_policy = write_policy
        self.selective_threshold = selective_threshold
        self.eviction_policy = eviction_policy
        self._device_kv = device_kv
        self._device_state = device_state
        self._host_kv = host_kv
        self._host_state = host_state

        root = TreeNode(0, (), None)
        root.device_pages = []  # the empty prefix is always "on" both tiers: top-closure ends here
        root.host_pages = []
        self._root = root
        self._next_id = 1
        self._num_nodes = 1
        self._tick = 0
        self._next_op_id = 1
        self._pending_backups: dict[int, BackupOp] = {}
        self._pending_loads: dict[int, LoadOp] = {}
        self._taints: list[_Taint] = []  # failed orders' copies still to roll back
        self._tainted: set[TreeNode] = set()  # their nodes, for the match paths' membership test

        self._dev_leaves: EvictionQueue = make_queue(eviction_policy, seed)
        self._dev_states: EvictionQueue = make_queue(eviction_policy, seed + 1)
        self._host_leaves: EvictionQueue = make_queue(eviction_policy, seed + 2)
        self._host_states: EvictionQueue = make_queue(eviction_policy, seed + 3)
        self._host_mirrors: EvictionQueue = make_queue(eviction_policy, seed + 4)

        self._dev_pages_used = 0
        self._dev_pages_protected = 0
        self._dev_states_used = 0
        self._dev_states_protected = 0
        self._host_pages_used = 0
        self._host_pages_protected = 0
        self._host_states_used = 0
        self._host_states_protected = 0

    # ------------------------------------------------------------------ usage

    @property
    def root(self) -> TreeNode:
        return self._root

    def usage(self) -> TreeUsage:
        """The pool counters at this moment (O(1)); see TreeUsage for what each one means."""
        return TreeUsage(
            self._num_nodes,
            self._dev_pages_used,
            self._dev_pages_protected,
            self._dev_states_used,
            self._dev_states_protected,
            self._host_pages_used,
            self._host_pages_protected,
            self._host_states_used,
            self._host_states_protected,
            len(self._pending_backups),
            len(self._pending_loads),
            len(self._taints),
        )

    # ------------------------------------------------------------------ match

    def match_prefix(self, tokens: Sequence[int], *, touch: bool = True) -> MatchResult:
        """Longest cached prefix of `tokens` that ends at a state (whole pages only).

        May split a node where the match ends inside it; never frees device memory (a
        write_through_selective backup may evict host entries to make room). With `touch`, counts
        the hit as `record_hit` does: refreshes KV recency of root..node and the state recency of
        `node` only, and counts a hit on root..node (write_through_selective may then return backup
        orders in `backups`). Without it, nothing but splits changes.
        """
        toks = tokens if type(tokens) is tuple else tuple(tokens)
        ps = self.page_size
        end = len(toks) - len(toks) % ps
        root = self._root
        node = root
        pos = 0
        path: list[TreeNode] = []
        best = root
        best_len = 0
        best_depth = 0
        dev_best = root
        dev_best_len = 0
        tainted = self._tainted
        while pos < end:
            child = node.children.get(toks[pos : pos + ps])
            if child is None or (tainted and child in tainted):
                break
            key = child.key
            klen = len(key)
            if pos + klen <= end and toks[pos : pos + klen] == key:
                pos += klen
                partial = False
            else:
                m = self._common_len(toks, pos, end, key)
                child = self._split(child, m)
                pos += m
                partial = True
            path.append(child)
            node = child
            if child.device_state is not None:
                best = dev_best = child
                best_len = dev_best_len = pos
                best_depth = len(path)
            elif child.host_state is not None:
                best = child
                best_len = pos
                best_depth = len(path)
            if partial:
                break

        device_pages: list[int] = []
        device_len = 0
        hit_path = tuple(path[:best_depth])
        for n in hit_path:
            dp = n.device_pages
            if dp is not None:
                device_pages += dp
                device_len += len(n.key)
        tier: StateTier = "none" if best is root else ("device" if best.device_state is not None else "host")
        m = MatchResult(
            best,
            best_len,
            device_pages,
            device_len,
            best_len - device_len,
            tier,
            pos,
            dev_best,
            dev_best_len,
            [],
            hit_path,
        )
        return self.record_hit(m) if touch else m

    def record_hit(self, m: MatchResult) -> MatchResult:
        """Count a hit on what `match_prefix(..., touch=False)` found: hit counts, recency, and
        (write_through_selective) backup orders, returned in the result's `backups`. Done once
        per served request, so a request retried at admission is counted once."""
        self._tick += 1
        tick = self._tick
        dev_leaves = self._dev_leaves
        for n in m.path:
            if not n.is_attached:
                continue  # evicted since the match (the caller held no lock): nothing to count
            n.hit_count += 1
            n.warm = True
            n.last_access = tick
            if n.device_pages is not None:
                if n in dev_leaves:
                    dev_leaves.touch(n, tick, True)
                if n in self._host_mirrors:
                    self._host_mirrors.touch(n, tick, True)
            elif n in self._host_leaves:
                self._host_leaves.touch(n, tick, True)
        best = m.node
        backups: list[BackupOp] = []
        if best is not self._root and best.is_attached:
            best.state_hit_count += 1
            best.state_warm = True
            best.state_access = tick
            if best.device_state is not None and best in self._dev_states:
                self._dev_states.touch(best, tick, True)
            if best in self._host_states:
                self._host_states.touch(best, tick, True)
            if (
                self.write_policy == "write_through_selective"
                and best.hit_count >= self.selective_threshold
                and self._needs_backup(best)
            ):
                op = self.backup(best)
                if op is not None:
                    backups.append(op)
        return m._replace(backups=backups)

    def probe(self, tokens: Sequence[int]) -> ProbeResult:
        """How much of `tokens` the tree can serve, without touching recency or counts: the deepest
        prefix ending at a state (device or host) and the deepest prefix wholly on host."""
        toks = tokens if type(tokens) is tuple else tuple(tokens)
        ps = self.page_size
        end = len(toks) - len(toks) % ps
        node = self._root
        pos = 0
        cached = 0
        host_len = 0
        on_host = True
        while pos < end:
            child = node.children.get(toks[pos : pos + ps])
            if child is None or child in self._tainted:
                break
            key = child.key
            m = (
                len(key)
                if pos + len(key) <= end and toks[pos : pos + len(key)] == key
                else self._common_len(toks, pos, end, key)
            )
            on_host = on_host and child.host_pages is not None
            if on_host:
                host_len = pos + m
            if m == len(key) and (child.device_state is not None or child.host_state is not None):
                cached = pos + m
            if m < len(key):
                break
            pos += m
            node = child
        return ProbeResult(cached, host_len)

    def match_prefix_host(self, tokens: Sequence[int]) -> TreeNode | None:
        """The node ending exactly at len(tokens) (whole pages) with root..node on host, splitting
        a node where the prefix ends inside it; None when the tree does not hold that on host."""
        toks = tokens if type(tokens) is tuple else tuple(tokens)
        ps = self.page_size
        if len(toks) % ps or not toks:
            return None
        node = self._root
        pos = 0
        while pos < len(toks):
            child = node.children.get(toks[pos : pos + ps])
            if child is None or child.host_pages is None or child in self._tainted:
                return None
            key = child.key
            if pos + len(key) <= len(toks) and toks[pos : pos + len(key)] == key:
                m = len(key)
            else:
                m = self._common_len(toks, pos, len(toks), key)
                if pos + m < len(toks):
                    return None
                child = self._split(child, m)
            pos += m
            node = child
        return node

    def _common_len(self, toks: tuple[int, ...], pos: int, end: int, key: tuple[int, ...]) -> int:
        """Tokens (whole pages, >= 1 page) that toks[pos:end] shares with key; the first page is known equal."""
        ps = self.page_size
        limit = min(len(key), end - pos)
        m = ps
        while m < limit and toks[pos + m : pos + m + ps] == key[m : m + ps]:
            m += ps
        return m

    def _split(self, node: TreeNode, m: int) -> TreeNode:
        """Cut `node` after m tokens; the new upper node is returned, `node` keeps the lower part."""
        ps = self.page_size
        k = m // ps
        parent = node.parent
        assert parent is not None and 0 < m < len(node.key) and m % ps == 0
        upper = TreeNode(self._next_id, node.key[:m], parent)
        self._next_id += 1
        self._num_nodes += 1
        node.key = node.key[m:]
        parent.children[upper.key[:ps]] = upper
        upper.children[node.key[:ps]] = node
        node.parent = upper
        if node.device_pages is not None:
            upper.device_pages = node.device_pages[:k]
            node.device_pages = node.device_pages[k:]
            upper.num_device_children = 1
            if node in self._dev_leaves:
                self._dev_leaves.set_weight(node, len(node.device_pages))
        if node.host_pages is not None:
            upper.host_pages = node.host_pages[:k]
            node.host_pages = node.host_pages[k:]
            upper.num_host_children = 1
            # The pages split, so the protected total stays; upper is held exactly when node is.
            upper.host_held = node.host_held
            upper.num_held_host_children = int(node.host_held)
            if node in self._host_leaves:
                self._host_leaves.set_weight(node, len(node.host_pages))
            if node in self._host_mirrors:
                self._host_mirrors.set_weight(node, len(node.host_pages))
        if node.page_hashes is not None:
            upper.page_hashes = node.page_hashes[:k]
            node.page_hashes = node.page_hashes[k:]
        # Both halves carry every count taken over the whole node, so receipts stay balanced.
        upper.lock_ref = node.lock_ref
        upper.host_ref = node.host_ref
        upper.hit_count = node.hit_count
        upper.warm = node.warm
        upper.last_access = node.last_access
        upper.state_access = node.state_access
        if node in self._tainted:
            self._retaint_split(node, upper)
        return upper

    # ------------------------------------------------------------------ locks

    def lock(self, node: TreeNode, *, state: bool = True) -> LockReceipt:
        """Lock the device KV of node and its on-device ancestors, and (with `state`) node's device
        state if any. A request that already has its own copy of the state locks the KV only."""
        self._check_attached(node, "node")
        root = self._root
        d = node
        while d.device_pages is None:
            d = d.parent  # type: ignore[assignment]  # the root has pages, so the walk stops
        state_node = None
        if state and node.device_state is not None:
            if node.mamba_lock_ref == 0:
                self._dev_states_protected += 1
                self._dev_states.discard(node)
            node.mamba_lock_ref += 1
            state_node = node
        n = d
        dev_leaves = self._dev_leaves
        while n is not root:
            if n.lock_ref == 0:
                self._dev_pages_protected += len(n.device_pages)  # type: ignore[arg-type]
                dev_leaves.discard(n)
            n.lock_ref += 1
            n = n.parent  # type: ignore[assignment]
        return LockReceipt(node, d if d is not root else None, state_node)

    def lock_cost(self, node: TreeNode, *, state: bool = True) -> LockCost:
        """What `lock(node, state=state)` would protect that is evictable now, counted without
        locking: a check can ask it and change nothing (nano-vllm's can_allocate before allocate)."""
        self._check_attached(node, "node")
        root = self._root
        n = node
        while n.device_pages is None:
            n = n.parent  # type: ignore[assignment]  # the root has pages, so the walk stops
        pages = 0
        # A locked node has locked ancestors (parent.lock_ref >= its device children's), so the
        # walk stops at the first one.
        while n is not root and n.lock_ref == 0:
            pages += len(n.device_pages)  # type: ignore[arg-type]
            n = n.parent  # type: ignore[assignment]
        states = int(state and node.device_state is not None and node.mamba_lock_ref == 0)
        return LockCost(pages, states)

    def unlock(self, receipt: LockReceipt) -> None:
        """Release exactly what the receipt recorded; ValueError if it was already released."""
        if receipt.released:
            raise ValueError("receipt: already unlocked")
        receipt.released = True
        s = receipt.state_node
        if s is not None:
            if s.mamba_lock_ref <= 0:
                raise RuntimeError(f"node {s.id}: mamba_lock_ref released below zero")
            s.mamba_lock_ref -= 1
            if s.mamba_lock_ref == 0:
                self._dev_states_protected -= 1
                self._sync_dev_state(s)
        root = self._root
        n = receipt.device_node
        while n is not None and n is not root:
            if n.lock_ref <= 0:
                raise RuntimeError(f"node {n.id}: lock_ref released below zero")
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._dev_pages_protected -= len(n.device_pages)  # type: ignore[arg-type]
                self._sync_dev_leaf(n)
            n = n.parent

    def protect_host(self, node: TreeNode, *, kv: bool = True, state: bool = False) -> HostPin:
        """Pin node's host KV and/or host state against host eviction (e.g. for a storage transfer).

        The pin survives splits of the node: release it with `release_host(pin)`."""
        self._check_attached(node, "node")
        if node is self._root:
            raise ValueError("node: the root holds nothing to protect")
        if kv and node.host_pages is None:
            raise ValueError(f"node: node {node.id} has no host KV to protect")
        if state and node.host_state is None:
            raise ValueError(f"node: node {node.id} has no host state to protect")
        if kv:
            self._protect_host_kv(node)
        if state:
            self._protect_host_state(node)
        return HostPin(node, kv, state, node.parent)  # type: ignore[arg-type]

    def release_host(self, pin: HostPin) -> None:
        """Release exactly what the pin took; ValueError if it was already released."""
        if pin.released:
            raise ValueError("pin: already released")
        pin.released = True
        self._release_range(pin.node if pin.kv else None, pin.top, pin.node if pin.state else None)

    # ------------------------------------------------------------------ insert

    def insert(
        self,
        tokens: Sequence[int],
        device_pages: Sequence[int],
        state_slot: int | None = None,
        locked_prefix_len: int = 0,
    ) -> InsertResult:
        """Add tokens (whole pages) with their device pages and optionally the state at their end.

        Ownership of every page and of state_slot passes to the tree: where the tree already has
        device KV the caller's page is a duplicate and is freed (unless it is the very same index),
        a host-only node is revived with the caller's pages, and a state slot that is not needed
        (the end node already has a device state) is freed. The first `locked_prefix_len` tokens
        must be the tree's own device pages (the caller's locked match); ValueError otherwise.
        """
        toks = tokens if type(tokens) is tuple else tuple(tokens)
        pages = device_pages if type(device_pages) is list else list(device_pages)
        ps = self.page_size
        n_tok = len(toks)
        if n_tok % ps:
            raise ValueError(f"tokens: length {n_tok} is not a multiple of page_size {ps}")
        if len(pages) * ps != n_tok:
            raise ValueError(f"device_pages: {len(pages)} pages for {n_tok} tokens (page_size {ps})")
        if locked_prefix_len < 0 or locked_prefix_len > n_tok or locked_prefix_len % ps:
            raise ValueError(f"locked_prefix_len: {locked_prefix_len} is not a page multiple in [0, {n_tok}]")

        self._tick += 1
        tick = self._tick
        dev_leaves = self._dev_leaves
        node = self._root
        pos = 0
        canonical: list[int] = []
        dups: list[int] = []
        while pos < n_tok:
            child = node.children.get(toks[pos : pos + ps])
            if child is None:
                if pos < locked_prefix_len:
                    raise ValueError(f"locked_prefix_len: tokens from {pos} on are not in the tree")
                leaf = self._new_leaf(node, toks[pos:], pages[pos // ps :], tick)
                canonical += leaf.device_pages  # type: ignore[arg-type]
                node = leaf
                break
            key = child.key
            klen = len(key)
            if pos + klen <= n_tok and toks[pos : pos + klen] == key:
                m = klen
            else:
                m = self._common_len(toks, pos, n_tok, key)
                child = self._split(child, m)
            i0 = pos // ps
            seg = pages[i0 : i0 + m // ps]
            tree_pages = child.device_pages
            child.last_access = tick
            if tree_pages is None:
                if pos < locked_prefix_len:
                    raise ValueError(f"locked_prefix_len: tokens [{pos}, {pos + m}) are not on device in the tree")
                self._revive(child, seg)
                canonical += seg
            else:
                if tree_pages != seg:
                    if pos < locked_prefix_len:
                        k = min(m, locked_prefix_len - pos) // ps
                        if tree_pages[:k] != seg[:k]:
                            raise ValueError(
                                f"device_pages: the locked prefix [{pos}, {pos + k * ps}) differs from the tree's pages"
                            )
                    for mine, theirs in zip(seg, tree_pages):
                        if mine != theirs:
                            dups.append(mine)
                canonical += tree_pages
                if child in dev_leaves:
                    dev_leaves.touch(child, tick, child.warm)
                if child in self._host_mirrors:
                    self._host_mirrors.touch(child, tick, child.warm)
            pos += m
            node = child

        if dups:
            self._device_kv.free(dups)
        state_used = False
        if state_slot is not None:
            if node is not self._root and node.device_state is None:
                node.device_state = state_slot
                node.state_access = tick
                node.state_warm = node.state_warm or node.warm
                self._dev_states_used += 1
                self._sync_dev_state(node)
                self._supersede_ancestor_state(node)
                state_used = True
            elif node.device_state == state_slot:
                state_used = True  # the tree's own slot handed back: nothing to do
            else:
                self._device_state.free([state_slot])
        backups: list[BackupOp] = []
        if self.write_policy == "write_through" and node is not self._root and self._needs_backup(node):
            op = self.backup(node)
            if op is not None:
                backups.append(op)
        return InsertResult(node, canonical, len(dups), state_used, backups)

    def insert_host(
        self,
        tokens: Sequence[int],
        first_page: int,
        host_pages: Sequence[int],
        host_state: int | None = None,
        page_hashes: Sequence[bytes] | None = None,
    ) -> HostInsertResult:
        """Prefetch-insert: pages [first_page, n) of `tokens` arrived in host memory (`host_pages[i]`
        holds page first_page + i), with optionally the host state at their end.

        Ownership passes to the tree: a page whose node already has host KV is a duplicate and
        is freed; a node without host KV (device-only) gets the page as its host copy; missing
        nodes become host-only leaves. The state attaches to the node ending exactly at
        len(tokens), even when that node existed without one. Pages before `first_page` must be
        on host in the tree (the caller pinned them); if they are not, the rest is freed and
        `attached` is False. `page_hashes` (one key per page of `tokens`) label new nodes.
        """
        toks = tokens if type(tokens) is tuple else tuple(tokens)
        hp = list(host_pages)
        ps = self.page_size
        n_tok = len(toks)
        if self._host_kv is None:
            raise ValueError("host_pages: there is no host tier")
        if n_tok % ps or first_page < 0 or (n_tok // ps - first_page) != len(hp):
            raise ValueError(f"host_pages: {len(hp)} pages from page {first_page} for {n_tok} tokens")
        if host_state is not None and self._host_state is None:
            raise ValueError("host_state: there is no host state pool")
        if page_hashes is not None and len(page_hashes) * ps != n_tok:
            raise ValueError(f"page_hashes: {len(page_hashes)} keys for {n_tok} tokens")
        fp_tok = first_page * ps
        self._tick += 1
        tick = self._tick
        node = self._root
        pos = 0
        dups: list[int] = []
        attached = True
        while pos < n_tok:
            child = node.children.get(toks[pos : pos + ps])
            if child is None:
                if pos < fp_tok:
                    attached = False
                    break
                leaf = TreeNode(self._next_id, toks[pos:], node)
                self._next_id += 1
                self._num_nodes += 1
                leaf.host_pages = hp[(pos - fp_tok) // ps :]
                leaf.last_access = tick
                leaf.state_access = tick
                if page_hashes is not None:
                    leaf.page_hashes = list(page_hashes[pos // ps :])
                node.children[leaf.key[:ps]] = leaf
                self._host_pages_used += len(leaf.host_pages)
                node.num_host_children += 1
                self._sync_host_kv(node)
                self._sync_host_kv(leaf)
                node = leaf
                pos = n_tok
                break
            key = child.key
            limit = n_tok if pos >= fp_tok else fp_tok  # nodes lie wholly before or inside the fetched range
            if pos + len(key) <= limit and toks[pos : pos + len(key)] == key:
                m = len(key)
            else:
                m = self._common_len(toks, pos, limit, key)
                child = self._split(child, m)
            if pos >= fp_tok:
                seg = hp[(pos - fp_tok) // ps : (pos + m - fp_tok) // ps]
                if child.host_pages is None:
                    child.host_pages = seg
                    self._host_pages_used += len(seg)
                    node.num_host_children += 1
                    if page_hashes is not None and child.page_hashes is None:
                        child.page_hashes = list(page_hashes[pos // ps : (pos + m) // ps])
                    self._sync_host_kv(node)
                    self._sync_host_kv(child)
                else:
                    dups += seg
            elif child.host_pages is None:
                attached = False
                break
            pos += m
            node = child
        if not attached:
            dups += hp[max(0, (pos - fp_tok) // ps) :]
        if dups:
            self._host_kv.free(dups)
        state_used = False
        if host_state is not None:
            if attached and node is not self._root and node.host_state is None:
                node.host_state = host_state
                node.state_access = tick
                self._host_states_used += 1
                self._sync_host_state(node)
                state_used = True
            else:
                self._host_state.free([host_state])  # type: ignore[union-attr]
        return HostInsertResult(node, attached, len(dups), state_used)

    def _supersede_ancestor_state(self, node: TreeNode) -> None:
        """A conversation moved on: the nearest state above `node` expires if nothing else uses it.

        In a multi-turn chain each turn's state is consumed once, by the next turn, which then
        inserts a deeper state; the consumed one is now dead weight yet was just touched, so LRU
        would keep it over the frontier states of other conversations. A state at a branch point
        (more than one child) or consumed more than once is shared and keeps its recency.
        """
        root = self._root
        y = node.parent
        while y is not root and y.device_state is None and y.host_state is None:
            y = y.parent  # type: ignore[assignment]
        if y is root or y.state_hit_count > 1 or len(y.children) != 1:  # type: ignore[union-attr]
            return
        y.state_access = EXPIRED  # type: ignore[union-attr]
        y.state_warm = False  # type: ignore[union-attr]
        if y in self._dev_states:
            self._dev_states.touch(y, EXPIRED, False)
        if y in self._host_states:
            self._host_states.touch(y, EXPIRED, False)

    def _new_leaf(self, parent: TreeNode, key: tuple[int, ...], pages: list[int], tick: int) -> TreeNode:
        leaf = TreeNode(self._next_id, key, parent)
        self._next_id += 1
        self._num_nodes += 1
        leaf.device_pages = pages
        leaf.last_access = tick
        leaf.state_access = tick
        leaf.warm = parent.warm  # extending a prefix that was hit: likely the next turn's prefix
        parent.children[key[: self.page_size]] = leaf
        self._dev_pages_used += len(pages)
        self._add_device_child(parent)
        self._dev_leaves.add(leaf, tick, leaf.warm, len(pages))
        return leaf

    def _revive(self, node: TreeNode, pages: list[int]) -> None:
        """Give a host-only node device pages (its parent is already on device)."""
        assert node.lock_ref == 0 and node.device_state is None
        node.device_pages = pages
        self._dev_pages_used += len(pages)
        self._add_device_child(node.parent)  # type: ignore[arg-type]
        self._sync_dev_leaf(node)
        self._sync_host_kv(node)

    def _add_device_child(self, parent: TreeNode) -> None:
        parent.num_device_children += 1
        if parent.num_device_children == 1:
            self._dev_leaves.discard(parent)

    # ------------------------------------------------------------------ eviction

    def evict(self, num_pages: int) -> EvictResult:
        """Free at least num_pages device pages if possible, over unlocked device leaves in policy order.

        Backed-up leaves are demoted to host; others are backed up first under write_back (the order
        is in the result), else deleted with their childless, stateless, unreferenced ancestors.
        Never raises on exhaustion: the result says what was freed.
        """
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        acc = _Freed(self)
        target = self._dev_pages_used - num_pages
        while self._dev_pages_used > target:
            n = self._dev_leaves.pop()
            if n is None:
                break
            self._evict_device(n, acc)
        return acc.result(self)

    def evict_state(self, num_slots: int) -> EvictResult:
        """Free device state slots over unlocked states in policy order: an unlocked device leaf is
        evicted entirely (as `evict`), any other node loses only its state (its KV stays)."""
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        acc = _Freed(self)
        target = self._dev_states_used - num_slots
        while self._dev_states_used > target:
            n = self._dev_states.pop()
            if n is None:
                break
            if n.lock_ref == 0 and n.num_device_children == 0:
                self._dev_leaves.discard(n)
                self._evict_device(n, acc)
            else:
                self._device_state.free([n.device_state])  # type: ignore[list-item]
                n.device_state = None
                self._dev_states_used -= 1
                if n.num_device_children == 0:
                    # A locked leaf keeps its KV, yet without a state below it that KV serves no
                    # hit: it goes first once unlocked, not when LRU reaches it.
                    n.last_access = EXPIRED
        return acc.result(self)

    def evict_host(self, num_pages: int) -> EvictResult:
        """Free host pages: delete unprotected host-only leaves (no children) in policy order, then,
        once none is left, drop the host copies of device nodes without a child on host (mirrors).

        Never frees device memory, so match_prefix / insert results stay valid across it.
        """
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        acc = _Freed(self)
        target = self._host_pages_used - num_pages
        while self._host_pages_used > target:
            n = self._host_leaves.pop()
            if n is not None:
                self._delete(n, acc, on_device=False)
                continue
            n = self._host_mirrors.pop()
            if n is None:
                break
            self._drop_mirror(n)
        return acc.result(self)

    def _drop_mirror(self, n: TreeNode) -> None:
        """Free the host KV and host state of a device node (no longer in the mirror queue); the node stays."""
        pages = n.host_pages
        assert pages is not None and n.device_pages is not None and n.num_host_children == 0
        assert n.host_ref == 0 and n.host_mamba_ref == 0 and not n.host_held
        self._host_kv.free(pages)  # type: ignore[union-attr]
        self._host_pages_used -= len(pages)
        n.host_pages = None
        if n.host_state is not None:
            self._host_states.discard(n)
            self._host_state.free([n.host_state])  # type: ignore[union-attr]
            n.host_state = None
            self._host_states_used -= 1
        parent = n.parent
        assert parent is not None
        parent.num_host_children -= 1
        if parent is not self._root:
            self._sync_host_kv(parent)  # may be a mirror now: deepest-first falls out of this

    def evict_host_state(self, num_slots: int) -> EvictResult:
        """Free host state slots over unprotected host states: a host leaf is deleted entirely, any
        other node loses only its host state."""
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        acc = _Freed(self)
        target = self._host_states_used - num_slots
        while self._host_states_used > target:
            n = self._host_states.pop()
            if n is None:
                break
            if n in self._host_leaves:
                self._host_leaves.discard(n)
                self._delete(n, acc, on_device=False)
            else:
                self._host_state.free([n.host_state])  # type: ignore[union-attr, list-item]
                n.host_state = None
                self._host_states_used -= 1
        return acc.result(self)

    def _evict_device(self, n: TreeNode, acc: _Freed) -> None:
        """Take an unlocked device leaf off the device (it is no longer in the device-leaf queue)."""
        assert n.lock_ref == 0 and n.num_device_children == 0 and n.device_pages is not None
        if self.write_policy == "write_back" and self._needs_backup(n):
            op = self.backup(n)
            if op is not None:
                acc.backups.append(op)
        if n.host_pages is not None:
            self._demote(n, acc)
        else:
            self._delete(n, acc, on_device=True)

    def _demote(self, n: TreeNode, acc: _Freed) -> None:
        """Free device KV and device state; the node stays, host-only."""
        pages = n.device_pages
        assert pages is not None and n.mamba_lock_ref == 0
        n.device_pages = None
        # A write_back backup just before may have re-queued n (its host eviction can delete n's
        # last child, making n a device leaf again), so drop it from the queue explicitly.
        self._dev_leaves.discard(n)
        self._device_kv.free(pages)
        self._dev_pages_used -= len(pages)
        if n.device_state is not None:
            self._dev_states.discard(n)
            self._device_state.free([n.device_state])
            n.device_state = None
            self._dev_states_used -= 1
        parent = n.parent
        assert parent is not None
        parent.num_device_children -= 1
        self._sync_dev_leaf(parent)
        self._sync_host_kv(n)

    def _delete(self, n: TreeNode, acc: _Freed, on_device: bool) -> None:
        """Delete a childless, unreferenced node with everything it holds, then its dead ancestors.

        on_device=False (host eviction) stops the cascade at a node on device: host eviction never
        frees device memory, so the results of match_prefix / insert stay valid across it.
        """
        while True:
            assert not n.children and n.lock_ref == 0 and n.mamba_lock_ref == 0
            assert n.host_ref == 0 and n.host_mamba_ref == 0 and not n.host_held
            parent = n.parent
            assert parent is not None
            if n.device_pages is not None:
                self._dev_leaves.discard(n)
                self._device_kv.free(n.device_pages)
                self._dev_pages_used -= len(n.device_pages)
                n.device_pages = None
                parent.num_device_children -= 1
            if n.device_state is not None:
                self._dev_states.discard(n)
                self._device_state.free([n.device_state])
                n.device_state = None
                self._dev_states_used -= 1
            if n.host_pages is not None:
                self._host_leaves.discard(n)
                self._host_mirrors.discard(n)
                self._host_kv.free(n.host_pages)  # type: ignore[union-attr]
                self._host_pages_used -= len(n.host_pages)
                n.host_pages = None
                parent.num_host_children -= 1
            if n.host_state is not None:
                self._host_states.discard(n)
                self._host_state.free([n.host_state])  # type: ignore[union-attr]
                n.host_state = None
                self._host_states_used -= 1
            del parent.children[n.key[: self.page_size]]
            n.parent = None
            self._num_nodes -= 1
            # A childless ancestor with no state anywhere can never be a hit again: delete it too,
            # unless anything still references it (locks, transfers; sglang #22592/#23696).
            if (
                parent is self._root
                or parent.children
                or (parent.device_pages is not None and not on_device)
                or parent.device_state is not None
                or parent.host_state is not None
                or parent.lock_ref
                or parent.mamba_lock_ref
                or parent.host_ref
                or parent.host_mamba_ref
            ):
                if parent is not self._root:
                    self._sync_dev_leaf(parent)
                    self._sync_host_kv(parent)
                return
            n = parent

    # ------------------------------------------------------------------ host transfers

    def _needs_backup(self, node: TreeNode) -> bool:
        if self._host_kv is None:
            return False
        if node.host_pages is None:
            return True
        return node.device_state is not None and node.host_state is None and self._host_state is not None

    def backup(self, node: TreeNode) -> BackupOp | None:
        """Order a device -> host copy of node and its not-yet-backed-up ancestors (one op for the whole
        path), plus node's device state when it has no host copy. Host memory is allocated here,
        evicting host entries if needed. Returns None when there is nothing to copy or no host memory.
        """
        self._check_attached(node, "node")
        if self._host_kv is None or node.device_pages is None or node is self._root:
            return None
        seg: list[TreeNode] = []
        n = node
        while n.host_pages is None:
            seg.append(n)
            n = n.parent  # type: ignore[assignment]
        top = n
        want_state = node.device_state is not None and node.host_state is None and self._host_state is not None
        if not seg and not want_state:
            return None
        # Host eviction below cannot delete anything on this path: it deletes host-only leaves and then
        # childless stateless ancestors; nodes in `seg` have no host KV, hence no host-only
        # descendants, `node` keeps its device state or a child, and ancestors above keep a child.
        # It may drop mirrors, though: `top` is pinned meanwhile, as the copies will hang from it.
        host_pages: list[int] = []
        if seg:
            need = 0
            for x in seg:
                need += len(x.device_pages)  # type: ignore[arg-type]
            got = self._host_kv.alloc(need)
            if got is None:
                guard = top is not self._root
                if guard:
                    self._protect_host_kv(top)
                self.evict_host(need - self._host_kv.num_free)
                if guard:
                    self._release_host_kv(top)
                got = self._host_kv.alloc(need)
                if got is None:
                    return None
            host_pages = got
        host_slot = None
        if want_state:
            assert self._host_state is not None
            slots = self._host_state.alloc(1)
            if slots is None:
                self.evict_host_state(1)
                slots = self._host_state.alloc(1)
            if slots is not None:
                host_slot = slots[0]
            elif not seg:
                return None
        dev_flat: list[int] = []
        off = 0
        for x in reversed(seg):
            dp = x.device_pages
            k = len(dp)  # type: ignore[arg-type]
            x.host_pages = host_pages[off : off + k]
            off += k
            dev_flat += dp  # type: ignore[arg-type]
            self._host_pages_used += k
            self._protect_host_kv(x)
            x.parent.num_host_children += 1  # type: ignore[union-attr]
            self._sync_host_kv(x.parent)  # type: ignore[arg-type]  # `top` is no mirror any more
        dev_states: list[int] = []
        host_states: list[int] = []
        if host_slot is not None:
            node.host_state = host_slot
            self._host_states_used += 1
            self._protect_host_state(node)
            dev_states.append(node.device_state)  # type: ignore[arg-type]
            host_states.append(host_slot)
        op = BackupOp(
            self._next_op_id,
            dev_flat,
            host_pages,
            dev_states,
            host_states,
            node,
            node if seg else None,
            top,
            node if host_slot is not None else None,
        )
        self._next_op_id += 1
        self._pending_backups[op.op_id] = op
        return op

    def backup_done(self, op: BackupOp) -> None:
        """The worker finished a backup: release exactly the host protection the op took."""
        if self._pending_backups.pop(op.op_id, None) is not op:
            raise ValueError(f"op: backup {op.op_id} is not pending in this tree")
        self._release_range(op._bottom, op._top, op._state_node)

    def load_back(self, node: TreeNode) -> LoadOp | None:
        """Order a host -> device copy of the host-only part of root..node, plus node's state when it is
        on host only. Device pages (and a slot) are allocated here, evicting device entries other
        than this path, and assigned to the nodes at once; the host side stays protected until
        `load_back_done`. Returns None (changing nothing) when there is nothing to load or the
        device memory cannot be had. Lock the node afterwards to keep what was loaded.
        """
        self._check_attached(node, "node")
        if node is self._root:
            return None
        seg: list[TreeNode] = []
        n = node
        while n.device_pages is None:
            seg.append(n)
            n = n.parent  # type: ignore[assignment]
        top = n
        want_state = node.device_state is None and node.host_state is not None
        if not seg and not want_state:
            return None
        need = 0
        for x in seg:
            need += len(x.host_pages)  # type: ignore[arg-type]
        receipt = self.lock(node)
        try:
            # Everything unlocked is evictable, so this decides up front and never evicts in vain.
            if self._device_kv.num_free + self._dev_pages_used - self._dev_pages_protected < need:
                return None
            if want_state and self._device_state.num_free + self._dev_states_used - self._dev_states_protected < 1:
                return None
            for x in seg:
                self._protect_host_kv(x)
            if want_state:
                self._protect_host_state(node)
            backups: list[BackupOp] = []
            pages = self._device_kv.alloc(need)
            if pages is None:
                backups += self.evict(need - self._device_kv.num_free).backups
                pages = self._device_kv.alloc(need)
            slot = None
            if want_state and pages is not None:
                got = self._device_state.alloc(1)
                if got is None:
                    backups += self.evict_state(1).backups
                    got = self._device_state.alloc(1)
                slot = got[0] if got is not None else None
            if pages is None or (want_state and slot is None):
                # Unreachable: everything unlocked is evictable and was counted above. Failing here
                # would drop the backup orders just issued, so stop loudly instead.
                raise RuntimeError(f"load_back: node {node.id}: eviction freed less than it counted")

            self._tick += 1
            tick = self._tick
            host_flat: list[int] = []
            off = 0
            for x in reversed(seg):
                hp = x.host_pages
                k = len(hp)  # type: ignore[arg-type]
                x.last_access = tick
                self._revive(x, pages[off : off + k])
                off += k
                host_flat += hp  # type: ignore[arg-type]
            dev_states: list[int] = []
            host_states: list[int] = []
            if slot is not None:
                node.device_state = slot
                node.state_access = tick
                self._dev_states_used += 1
                self._sync_dev_state(node)
                dev_states.append(slot)
                host_states.append(node.host_state)  # type: ignore[arg-type]
            op = LoadOp(
                self._next_op_id,
                pages,
                host_flat,
                dev_states,
                host_states,
                node,
                backups,
                node if seg else None,
                top,
                node if slot is not None else None,
            )
            self._next_op_id += 1
            self._pending_loads[op.op_id] = op
            return op
        finally:
            self.unlock(receipt)

    def load_back_done(self, op: LoadOp) -> None:
        """The worker finished a load: release exactly the host protection the op took."""
        if self._pending_loads.pop(op.op_id, None) is not op:
            raise ValueError(f"op: load {op.op_id} is not pending in this tree")
        self._release_range(op._bottom, op._top, op._state_node)

    # ------------------------------------------------------------------ failed transfers

    def backup_failed(self, op: BackupOp) -> bool:
        """The worker could not execute a backup: release its pins and drop the host copies it
        assigned (and what hangs below them on host). Whether the rollback is complete; if not,
        the rest happens in `retry_rollbacks` once nothing pins it, and the node stays tainted."""
        if self._pending_backups.pop(op.op_id, None) is not op:
            raise ValueError(f"op: backup {op.op_id} is not pending in this tree")
        self._release_range(op._bottom, op._top, op._state_node)
        return self._taint(op._bottom, op._top, op._state_node, "host")

    def load_back_failed(self, op: LoadOp) -> bool:
        """The worker could not execute a load: release its pins and drop the device copies it
        assigned (and what hangs below them on device); the host copies stay. As `backup_failed`."""
        if self._pending_loads.pop(op.op_id, None) is not op:
            raise ValueError(f"op: load {op.op_id} is not pending in this tree")
        self._release_range(op._bottom, op._top, op._state_node)
        return self._taint(op._bottom, op._top, op._state_node, "device")

    def tainted(self, node: TreeNode) -> bool:
        """Whether root..node runs through a copy a failed order never wrote (rollback pending)."""
        if not self._tainted:
            return False
        n: TreeNode | None = node
        while n is not None:
            if n in self._tainted:
                return True
            n = n.parent
        return False

    def retry_rollbacks(self) -> bool:
        """Roll back what failed orders left behind locks or pins; whether none is left."""
        if not self._taints:
            return True
        left = [t for t in self._taints if not self._roll_back(t)]
        self._taints = left
        self._tainted = {t.node for t in left}
        return not left

    def _taint(self, bottom: TreeNode | None, top: TreeNode, state_node: TreeNode | None, tier: str) -> bool:
        if bottom is not None:
            n = bottom
            while n.parent is not top:  # the range's highest node: its subtree is unwritten
                n = n.parent  # type: ignore[assignment]
            t = _Taint(n, tier, True)  # type: ignore[arg-type]
        else:
            assert state_node is not None
            t = _Taint(state_node, tier, False)  # type: ignore[arg-type]
        if self._roll_back(t):
            return True
        self._taints.append(t)
        self._tainted.add(t.node)
        return False

    def _retaint_split(self, node: TreeNode, upper: TreeNode) -> None:
        # A subtree taint covers the new upper half too (its pages are the failed copy's);
        # a state taint stays on the lower node, which keeps the state.
        for t in self._taints:
            if t.node is node and t.subtree:
                t.node = upper
        self._tainted = {t.node for t in self._taints}

    def _roll_back(self, t: _Taint) -> bool:
        """Drop the copies `t` names; False (nothing changed) while a lock or pin holds one."""
        x = t.node
        if not x.is_attached:
            return True  # deleted meanwhile, with everything it held
        if not t.subtree:
            return self._drop_state_copy(x, t.tier)
        on_tier = (lambda n: n.device_pages is not None) if t.tier == "device" else (lambda n: n.host_pages is not None)
        order: list[TreeNode] = []  # the subtree on the tier, deepest first (each tier is top-closed)
        stack = [x] if on_tier(x) else []
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(c for c in n.children.values() if on_tier(c))
        order.reverse()
        if t.tier == "device":
            return self._drop_device_copies(order)
        return self._drop_host_copies(order)

    def _drop_state_copy(self, n: TreeNode, tier: str) -> bool:
        if tier == "device":
            if n.device_state is None:
                return True
            if n.mamba_lock_ref:
                return False
            self._dev_states.discard(n)
            self._device_state.free([n.device_state])
            n.device_state = None
            self._dev_states_used -= 1
            return True
        if n.host_state is None:
            return True
        if n.host_mamba_ref:
            return False
        self._host_states.discard(n)
        self._host_state.free([n.host_state])  # type: ignore[union-attr]
        n.host_state = None
        self._host_states_used -= 1
        self._sync_host_kv(n)
        return True

    def _host_only_below(self, n: TreeNode) -> list[TreeNode]:
        """The host-only nodes under device node n, deepest first."""
        out: list[TreeNode] = []
        stack = [c for c in n.children.values() if c.device_pages is None]
        while stack:
            c = stack.pop()
            out.append(c)
            stack.extend(c.children.values())
        out.reverse()
        return out

    def _drop_device_copies(self, order: list[TreeNode]) -> bool:
        doomed: list[TreeNode] = []  # host-only nodes that lose the device parent they hang from
        for n in order:
            if n.lock_ref or n.mamba_lock_ref:
                return False
            if n.host_pages is None:
                doomed += self._host_only_below(n)
        if any(d.host_ref or d.host_mamba_ref for d in doomed):
            return False
        acc = _Freed(self)
        for d in doomed:
            if d.is_attached:
                self._delete(d, acc, on_device=False)
        for n in order:
            if not n.is_attached or n.device_pages is None:
                continue
            if n.host_pages is not None:
                self._demote(n, acc)
            else:
                self._delete(n, acc, on_device=True)
        return True

    def _drop_host_copies(self, order: list[TreeNode]) -> bool:
        if any(n.host_ref or n.host_mamba_ref for n in order):
            return False
        acc = _Freed(self)
        for n in order:
            if not n.is_attached or n.host_pages is None:
                continue
            if n.device_pages is not None:
                self._host_mirrors.discard(n)
                self._drop_mirror(n)
            else:
                self._host_leaves.discard(n)
                self._delete(n, acc, on_device=False)
        return True

    def _protect_host_kv(self, n: TreeNode) -> None:
        n.protect_host()
        if n.host_ref == 1:
            self._refresh_hold(n)
            self._sync_host_kv(n)

    def _protect_host_state(self, n: TreeNode) -> None:
        n.protect_host_mamba()
        if n.host_mamba_ref == 1:
            self._host_states_protected += 1
            self._host_states.discard(n)
            self._refresh_hold(n)
            self._sync_host_kv(n)

    def _release_host_kv(self, n: TreeNode) -> None:
        n.release_host()
        if n.host_ref == 0:
            self._refresh_hold(n)
            self._sync_host_kv(n)

    def _release_host_state(self, n: TreeNode) -> None:
        n.release_host_mamba()
        if n.host_mamba_ref == 0:
            self._host_states_protected -= 1
            self._sync_host_state(n)
            self._refresh_hold(n)
            self._sync_host_kv(n)

    def _refresh_hold(self, n: TreeNode) -> None:
        """After n's pins changed: update `host_held` up the path, and the protected page count.

        A pinned node keeps its host ancestors too (host KV is top-closed), so host_pages_protected
        counts them and host_pages_evictable stays what evict_host can really free. The walk stops
        at the first node whose status does not change.
        """
        root = self._root
        while n is not root:
            held = n.host_ref > 0 or n.host_mamba_ref > 0 or n.num_held_host_children > 0
            if held == n.host_held:
                return
            n.host_held = held
            step = 1 if held else -1
            self._host_pages_protected += step * len(n.host_pages)  # type: ignore[arg-type]
            n = n.parent  # type: ignore[assignment]
            n.num_held_host_children += step

    def _release_range(self, bottom: TreeNode | None, top: TreeNode, state_node: TreeNode | None) -> None:
        n = bottom
        while n is not None and n is not top:
            self._release_host_kv(n)
            n = n.parent
        if state_node is not None:
            self._release_host_state(state_node)

    # ------------------------------------------------------------------ queue membership

    def _sync_dev_leaf(self, n: TreeNode) -> None:
        want = n.device_pages is not None and n.lock_ref == 0 and n.num_device_children == 0 and n is not self._root
        q = self._dev_leaves
        if want:
            if n not in q:
                q.add(n, n.last_access, n.warm, len(n.device_pages))  # type: ignore[arg-type]
        else:
            q.discard(n)

    def _sync_dev_state(self, n: TreeNode) -> None:
        q = self._dev_states
        if n.device_state is not None and n.mamba_lock_ref == 0:
            if n not in q:
                q.add(n, n.state_access, n.state_warm, 1)
        else:
            q.discard(n)

    def _sync_host_kv(self, n: TreeNode) -> None:
        """Put n in the host-leaf queue (host-only) or the mirror queue (on device) when host eviction
        may free its host KV now, else in neither: unpinned, with no child on host."""
        free_now = (
            n.host_pages is not None
            and n.num_host_children == 0
            and n.host_ref == 0
            and n.host_mamba_ref == 0
            and n is not self._root
        )
        if n.device_pages is None:
            q, other = self._host_leaves, self._host_mirrors
        else:
            q, other = self._host_mirrors, self._host_leaves
        other.discard(n)
        if free_now:
            if n not in q:
                q.add(n, n.last_access, n.warm, len(n.host_pages))  # type: ignore[arg-type]
        else:
            q.discard(n)

    def _sync_host_state(self, n: TreeNode) -> None:
        q = self._host_states
        if n.host_state is not None and n.host_mamba_ref == 0:
            if n not in q:
                q.add(n, n.state_access, n.state_warm, 1)
        else:
            q.discard(n)

    def _check_attached(self, node: TreeNode, name: str) -> None:
        if node is not self._root and node.parent is None:
            raise ValueError(f"{name}: node {node.id} is no longer in the tree")

    # ------------------------------------------------------------------ checks

    def check_invariants(
        self,
        external_device_pages: Sequence[int] = (),
        external_device_slots: Sequence[int] = (),
        external_host_pages: Sequence[int] = (),
        external_host_slots: Sequence[int] = (),
    ) -> None:
        """Walk the whole tree and the pools; raise AssertionError naming the node and the problem.

        external_* are the indices owned outside the tree (running requests); every index of every
        pool must be free XOR owned by exactly one node XOR external. O(tree + pools): tests only.
        """
        check_tree(self, external_device_pages, external_device_slots, external_host_pages, external_host_slots)
