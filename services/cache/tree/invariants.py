"""The radix tree's invariant oracle: every structural rule, recomputed from scratch.

    root ─ A ─ B ─ C          device KV is top-closed: a node on device has its parent on device,
             └ D              host KV is top-closed too, and every non-root node holds KV on device
                              or on host (a node holding neither is deleted).
    state on device => KV on device;  state on host => KV on host.
    lock_ref >= mamba_lock_ref;  lock_ref > 0 => on device;  parent.lock_ref >= sum(device children).
    host_ref > 0 => host KV;  host_mamba_ref > 0 => host state.

Besides these, every counter in `TreeUsage`, every eviction queue's membership and every pool index
(free XOR owned by one node XOR owned outside the tree) is checked. O(tree + pools): tests only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from himamba.services.cache.tree.node import TreeNode

if TYPE_CHECKING:
    from himamba.services.cache.tree.radix_tree import RadixTree


def check_tree(
    tree: RadixTree,
    external_device_pages: Sequence[int] = (),
    external_device_slots: Sequence[int] = (),
    external_host_pages: Sequence[int] = (),
    external_host_slots: Sequence[int] = (),
) -> None:
    """Walk the whole tree and the pools; raise AssertionError naming the node and the problem.

    It recomputes from the nodes what the tree keeps incrementally (counters, queue membership, the
    host hold) and compares, so it reads the tree's private state: it is the tree's own oracle.

    external_* are the indices owned outside the tree (running requests); every index of every
    pool must be free XOR owned by exactly one node XOR external. O(tree + pools): tests only.
    """
    ps = tree.page_size
    root = tree._root

    def fail(node: TreeNode, what: str) -> None:
        raise AssertionError(f"node {node.id}: {what}")

    if root.key != () or root.device_pages != [] or root.host_pages != [] or root.parent is not None:
        fail(root, "root must have an empty key, [] pages on both tiers and no parent")
    if root.device_state is not None or root.host_state is not None:
        fail(root, "root must not hold a state")
    if root.lock_ref or root.mamba_lock_ref or root.host_ref or root.host_mamba_ref:
        fail(root, "root counters must stay 0")

    owner: dict[str, dict[int, int]] = {"device page": {}, "device slot": {}, "host page": {}, "host slot": {}}

    def own(kind: str, idx: int, node: TreeNode) -> None:
        held = owner[kind]
        if idx in held:
            fail(node, f"{kind} {idx} is also owned by node {held[idx]}")
        held[idx] = node.id

    totals = {k: 0 for k in ("dp_used", "dp_prot", "ds_used", "ds_prot", "hp_used", "hp_prot", "hs_used", "hs_prot")}
    want_dl: set[TreeNode] = set()
    want_ds: set[TreeNode] = set()
    want_hl: set[TreeNode] = set()
    want_hs: set[TreeNode] = set()
    want_hm: set[TreeNode] = set()
    order: list[TreeNode] = []  # parents before children: reversed, it is bottom-up
    num_nodes = 0
    ids: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        num_nodes += 1
        if node.id in ids:
            fail(node, "id is not unique")
        ids.add(node.id)
        order.append(node)
        dev_children = 0
        host_children = 0
        child_lock_sum = 0
        for k, c in node.children.items():
            if c.parent is not node:
                fail(c, f"parent link does not point to node {node.id}")
            if not c.key or len(c.key) % ps or c.key[:ps] != k:
                fail(c, f"key of length {len(c.key)} does not fit its child key in node {node.id}")
            if c.device_pages is not None:
                dev_children += 1
                child_lock_sum += c.lock_ref
            if c.host_pages is not None:
                host_children += 1
            stack.append(c)
        if dev_children != node.num_device_children:
            fail(node, f"num_device_children {node.num_device_children} != {dev_children}")
        if host_children != node.num_host_children:
            fail(node, f"num_host_children {node.num_host_children} != {host_children}")
        if node is root:
            continue
        for name in ("lock_ref", "mamba_lock_ref", "host_ref", "host_mamba_ref", "hit_count"):
            if getattr(node, name) < 0:
                fail(node, f"{name} is negative")
        parent = node.parent
        assert parent is not None
        npages = len(node.key) // ps
        dp, hp = node.device_pages, node.host_pages
        if dp is None and hp is None:
            fail(node, "holds KV on neither tier (should have been deleted)")
        if dp is not None:
            if len(dp) != npages:
                fail(node, f"{len(dp)} device pages for {npages} pages of key")
            if parent.device_pages is None:
                fail(node, "on device while its parent is not (device KV must be top-closed)")
            for p in dp:
                own("device page", p, node)
            totals["dp_used"] += npages
            if node.lock_ref:
                totals["dp_prot"] += npages
        if hp is not None:
            if len(hp) != npages:
                fail(node, f"{len(hp)} host pages for {npages} pages of key")
            if parent.host_pages is None:
                fail(node, "on host while its parent is not (host KV must be top-closed)")
            for p in hp:
                own("host page", p, node)
            totals["hp_used"] += npages
        if node.page_hashes is not None and len(node.page_hashes) != npages:
            fail(node, "page_hashes length differs from the page count")
        if node.device_state is not None:
            if dp is None:
                fail(node, "device state without device KV")
            own("device slot", node.device_state, node)
            totals["ds_used"] += 1
            if node.mamba_lock_ref:
                totals["ds_prot"] += 1
        if node.host_state is not None:
            if hp is None:
                fail(node, "host state without host KV")
            own("host slot", node.host_state, node)
            totals["hs_used"] += 1
            if node.host_mamba_ref:
                totals["hs_prot"] += 1
        if node.mamba_lock_ref > node.lock_ref:
            fail(node, f"mamba_lock_ref {node.mamba_lock_ref} > lock_ref {node.lock_ref}")
        if node.mamba_lock_ref and node.device_state is None:
            fail(node, "mamba_lock_ref > 0 without a device state")
        if node.lock_ref and dp is None:
            fail(node, "lock_ref > 0 while off device")
        if node.lock_ref < child_lock_sum:
            fail(node, f"lock_ref {node.lock_ref} < sum of device children's {child_lock_sum}")
        if node.host_ref and hp is None:
            fail(node, "host_ref > 0 without host KV")
        if node.host_mamba_ref and node.host_state is None:
            fail(node, "host_mamba_ref > 0 without a host state")
        if dp is not None and node.lock_ref == 0 and dev_children == 0:
            want_dl.add(node)
        if node.device_state is not None and node.mamba_lock_ref == 0:
            want_ds.add(node)
        if hp is not None and dp is None and not node.children and node.host_ref == 0 and node.host_mamba_ref == 0:
            want_hl.add(node)
        if hp is not None and dp is not None and not host_children and node.host_ref == 0 and node.host_mamba_ref == 0:
            want_hm.add(node)
        if node.host_state is not None and node.host_mamba_ref == 0:
            want_hs.add(node)

    usage = tree.usage()
    if num_nodes != usage.nodes:
        raise AssertionError(f"tree: num_nodes counter {usage.nodes} != {num_nodes} reachable")
    # Held host KV (host eviction cannot free it now): pinned, or above a held node.
    held: set[TreeNode] = set()
    for node in reversed(order):
        held_children = sum(c in held for c in node.children.values())
        if node.num_held_host_children != held_children:
            fail(node, f"num_held_host_children {node.num_held_host_children} != {held_children}")
        if node is root:
            continue
        is_held = node.host_ref > 0 or node.host_mamba_ref > 0 or held_children > 0
        if node.host_held != is_held:
            fail(node, f"host_held is {node.host_held}, recomputed {is_held}")
        if is_held:
            held.add(node)
            totals["hp_prot"] += len(node.host_pages)  # type: ignore[arg-type]
    for qname, q, want in (
        ("device-leaf queue", tree._dev_leaves, want_dl),
        ("device-state queue", tree._dev_states, want_ds),
        ("host-leaf queue", tree._host_leaves, want_hl),
        ("host-mirror queue", tree._host_mirrors, want_hm),
        ("host-state queue", tree._host_states, want_hs),
    ):
        q.check()
        have = set(q)
        for n in have - want:
            raise AssertionError(f"node {n.id}: in the {qname} but does not satisfy its condition")
        for n in want - have:
            raise AssertionError(f"node {n.id}: satisfies the {qname} condition but is not a member")

    for name, have_v, want_v in (
        ("device_pages_used", usage.device_pages_used, totals["dp_used"]),
        ("device_pages_protected", usage.device_pages_protected, totals["dp_prot"]),
        ("device_states_used", usage.device_states_used, totals["ds_used"]),
        ("device_states_protected", usage.device_states_protected, totals["ds_prot"]),
        ("host_pages_used", usage.host_pages_used, totals["hp_used"]),
        ("host_pages_protected", usage.host_pages_protected, totals["hp_prot"]),
        ("host_states_used", usage.host_states_used, totals["hs_used"]),
        ("host_states_protected", usage.host_states_protected, totals["hs_prot"]),
    ):
        if have_v != want_v:
            raise AssertionError(f"tree: counter {name} is {have_v}, recomputed {want_v}")

    for kind, pool, external in (
        ("device page", tree._device_kv, external_device_pages),
        ("device slot", tree._device_state, external_device_slots),
        ("host page", tree._host_kv, external_host_pages),
        ("host slot", tree._host_state, external_host_slots),
    ):
        owned = owner[kind]
        if pool is None:
            if owned or external:
                raise AssertionError(f"tree: {kind}s in use but there is no such pool")
            continue
        pool.check()
        seen: set[int] = set()
        for i in external:
            if i in seen or i in owned:
                raise AssertionError(f"tree: external {kind} {i} is also owned elsewhere")
            seen.add(i)
        for i in range(pool.capacity):
            holders = (i in owned) + (i in seen) + pool.is_free(i)
            if holders != 1:
                where = f"node {owned[i]}" if i in owned else ("external" if i in seen else "nobody")
                raise AssertionError(
                    f"tree: {kind} {i} is free={pool.is_free(i)} and owned by {where} ({holders} holders)"
                )
        for i in owned:
            if not (0 <= i < pool.capacity):
                raise AssertionError(f"node {owned[i]}: {kind} {i} is out of range")
        for i in seen:
            if not (0 <= i < pool.capacity):
                raise AssertionError(f"tree: external {kind} {i} is out of range")

    for op in tree._pending_backups.values():
        _check_op_range(op._bottom, op._top, op._state_node, f"backup {op.op_id}")
    for lop in tree._pending_loads.values():
        _check_op_range(lop._bottom, lop._top, lop._state_node, f"load {lop.op_id}")


def _check_op_range(bottom: TreeNode | None, top: TreeNode, state_node: TreeNode | None, what: str) -> None:
    n = bottom
    while n is not None and n is not top:
        if n.parent is None:
            raise AssertionError(f"node {n.id}: {what} walks off the tree before its top node {top.id}")
        if n.host_ref <= 0:
            raise AssertionError(f"node {n.id}: {what} is pending but host_ref is {n.host_ref}")
        n = n.parent
    if bottom is not None and n is None:
        raise AssertionError(f"{what}: range never reaches its top node {top.id}")
    if state_node is not None and state_node.host_mamba_ref <= 0:
        raise AssertionError(f"node {state_node.id}: {what} is pending but host_mamba_ref is 0")
