"""The tree's node and the receipts of what was counted on it.

A node is a run of whole pages. Its KV may be on device (`device_pages`), on host (`host_pages`) or
both; a recurrent state is valid only at the exact prefix length where it was captured, so a node
may hold a state (device slot and/or host slot) only at its END.

Reference counts. `lock_ref` counts requests using the node's device KV (a lock covers the node
and every on-device ancestor), `mamba_lock_ref` the requests using its device state. `host_ref`
and `host_mamba_ref` pin host KV and the host state while a transfer reads or writes them.

Receipts survive splits. A split keeps the original node object as the LOWER part (it keeps the
state, the children and the identity) and inserts a new upper node that inherits lock_ref and
host_ref. Every receipt or transfer therefore records only its deepest node and the exclusive
node above its range, and releases by walking parents: a split inside the range adds a node that
carries the same counts, and a split of the boundary node happens above the boundary.
"""

from __future__ import annotations

from dataclasses import dataclass


class TreeNode:
    """One run of whole pages. Fields are managed by RadixTree; read them, do not write them."""

    __slots__ = (
        "id",
        "key",
        "parent",
        "children",
        "device_pages",
        "device_state",
        "host_pages",
        "host_state",
        "lock_ref",
        "mamba_lock_ref",
        "host_ref",
        "host_mamba_ref",
        "hit_count",
        "state_hit_count",
        "last_access",
        "state_access",
        "num_device_children",
        "num_host_children",
        "num_held_host_children",
        "host_held",
        "warm",
        "state_warm",
        "page_hashes",
    )

    def __init__(self, node_id: int, key: tuple[int, ...], parent: TreeNode | None) -> None:
        self.id = node_id
        self.key = key
        self.parent = parent
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.device_pages: list[int] | None = None
        self.device_state: int | None = None
        self.host_pages: list[int] | None = None
        self.host_state: int | None = None
        self.lock_ref = 0
        self.mamba_lock_ref = 0
        self.host_ref = 0
        self.host_mamba_ref = 0
        self.hit_count = 0
        self.state_hit_count = 0
        self.last_access = 0  # KV recency (use stamp)
        self.state_access = 0  # state recency; refreshed only when this node's state is consumed
        self.num_device_children = 0
        self.num_host_children = 0
        # Host KV that host eviction cannot free now: pinned (host_ref / host_mamba_ref) or above a held
        # child, since host KV is top-closed. Kept by RadixTree._refresh_hold.
        self.num_held_host_children = 0
        self.host_held = False
        # Proven reuse, for scan-resistant eviction: the KV / the state was hit, or was inserted by a
        # request that continued a hit (the frontier of a conversation that is being reused).
        self.warm = False
        self.state_warm = False
        # Per-page storage keys, filled by the storage tier later; split together with the pages.
        self.page_hashes: list[bytes] | None = None

    def protect_host(self) -> None:
        """Count one more user of the host KV (the tree's protect_host keeps its sets in step)."""
        self.host_ref += 1

    def release_host(self) -> None:
        """Drop one user of the host KV; RuntimeError when it is already zero."""
        if self.host_ref <= 0:
            raise RuntimeError(f"node {self.id}: host_ref released below zero")
        self.host_ref -= 1

    def protect_host_mamba(self) -> None:
        """Count one more user of the host state."""
        self.host_mamba_ref += 1

    def release_host_mamba(self) -> None:
        """Drop one user of the host state; RuntimeError when it is already zero."""
        if self.host_mamba_ref <= 0:
            raise RuntimeError(f"node {self.id}: host_mamba_ref released below zero")
        self.host_mamba_ref -= 1

    @property
    def on_device(self) -> bool:
        return self.device_pages is not None

    @property
    def on_host(self) -> bool:
        return self.host_pages is not None

    @property
    def is_attached(self) -> bool:
        """False once the node was deleted from its tree (the root is always attached)."""
        return self.parent is not None or not self.key

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, len={len(self.key)}, dev={self.device_pages is not None}, "
            f"host={self.host_pages is not None}, dstate={self.device_state}, hstate={self.host_state}, "
            f"lock={self.lock_ref}/{self.mamba_lock_ref}, host_ref={self.host_ref}/{self.host_mamba_ref})"
        )


@dataclass(eq=False, slots=True)
class LockReceipt:
    """Exactly what `lock` incremented: lock_ref on `device_node` and each ancestor, and
    mamba_lock_ref on `state_node`. `unlock` replays it."""

    node: TreeNode
    device_node: TreeNode | None  # deepest locked node; None when nothing was on device
    state_node: TreeNode | None
    released: bool = False


@dataclass(eq=False, slots=True)
class HostPin:
    """Exactly what `protect_host` pinned: host_ref over node's range (node up to, not including,
    `top`, its parent at pin time) and/or host_mamba_ref on node. `release_host` replays it."""

    node: TreeNode
    kv: bool
    state: bool
    top: TreeNode
    released: bool = False
