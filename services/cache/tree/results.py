"""What the tree's operations return, and `TreeUsage`, the one summary of its pool counters."""

from __future__ import annotations

from typing import Literal, NamedTuple

from himamba.services.cache.tree.node import TreeNode
from himamba.services.cache.tree.orders import BackupOp

StateTier = Literal["device", "host", "none"]


class MatchResult(NamedTuple):
    """What a prefix match found. `node` is the deepest node with a state on device or host."""

    node: TreeNode
    cached_len: int  # tokens up to `node`: usable once the host part is loaded
    device_pages: list[int]  # device pages of the on-device part of root..node
    device_len: int
    host_len: int  # cached_len - device_len: KV to load from host
    state_tier: StateTier
    kv_match_len: int  # deepest whole-page KV match (device or host); may exceed cached_len
    device_node: TreeNode  # deepest node whose KV and state are both on device (usable without a load)
    device_cached_len: int
    backups: list[BackupOp]  # write_through_selective orders triggered by this hit
    path: tuple[TreeNode, ...] = ()  # root's child .. node (what `record_hit` counts)


class InsertResult(NamedTuple):
    """Outcome of an insert. `pages` are the tree's device pages for the inserted tokens."""

    node: TreeNode  # the node ending exactly at len(tokens) (root for empty tokens)
    pages: list[int]
    num_dup_freed: int
    state_used: bool  # False: the node already had a device state; the tree freed the given slot
    backups: list[BackupOp]


class HostInsertResult(NamedTuple):
    """Outcome of a prefetch-insert (`RadixTree.insert_host`)."""

    node: TreeNode  # the deepest node reached (ends at len(tokens) when attached)
    attached: bool  # False: the prefix before the fetched pages had left the host; the rest was freed
    num_dup_freed: int  # fetched pages freed because the tree already held them on host
    state_used: bool


class ProbeResult(NamedTuple):
    """What `RadixTree.probe` found for a prompt."""

    cached_len: int  # deepest prefix ending at a state (device or host)
    host_len: int  # deepest prefix wholly on host (the storage tier fetches from here)


class EvictResult(NamedTuple):
    """How much an eviction freed in each pool, and the backup orders it issued (write_back)."""

    num_pages: int
    num_states: int
    num_host_pages: int
    num_host_states: int
    backups: list[BackupOp]


class LockCost(NamedTuple):
    """What `RadixTree.lock` would take out of the evictable amounts, counted without locking."""

    pages: int  # device pages of the node's on-device path that no lock holds yet
    states: int  # 1 when the node's device state would be locked and no lock holds it yet


class TreeUsage(NamedTuple):
    """What the tree holds in each pool, and how much of it is protected, at one moment.

    Protected device pages are those of locked nodes; protected host pages are those host eviction
    cannot free now: pinned by host_ref or host_mamba_ref (a transfer reads or writes them) and their
    ancestors. What is used and not protected can all be freed by repeated evictions.
    """

    nodes: int  # root included
    device_pages_used: int
    device_pages_protected: int
    device_states_used: int
    device_states_protected: int
    host_pages_used: int
    host_pages_protected: int
    host_states_used: int
    host_states_protected: int
    pending_backups: int
    pending_loads: int
    taints: int  # failed orders whose rollback waits for a lock or pin to go

    @property
    def device_pages_evictable(self) -> int:
        """Device pages of unlocked nodes: all of them can be freed by repeated `evict`."""
        return self.device_pages_used - self.device_pages_protected

    @property
    def device_states_evictable(self) -> int:
        return self.device_states_used - self.device_states_protected

    @property
    def host_pages_evictable(self) -> int:
        """Host pages repeated `evict_host` can free: host-only nodes and mirrors of device nodes."""
        return self.host_pages_used - self.host_pages_protected

    @property
    def host_states_evictable(self) -> int:
        return self.host_states_used - self.host_states_protected
