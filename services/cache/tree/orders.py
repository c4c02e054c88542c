"""Copy orders between the tiers: what the worker copies, and the host range each one pins.

An order records only its deepest node and the exclusive node above its range (receipts survive
splits, see node.py); the tree releases the pins by walking parents when the order ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from himamba.services.cache.tree.node import TreeNode


@dataclass(frozen=True, eq=False, slots=True)
class BackupOp:
    """Device -> host copy order: device_pages[i] -> host_pages[i], device_states[i] -> host_states[i].

    The host side stays protected until `RadixTree.backup_done(op)`."""

    op_id: int
    device_pages: list[int]
    host_pages: list[int]
    device_states: list[int]
    host_states: list[int]
    node: TreeNode
    _bottom: TreeNode | None = field(repr=False)  # deepest node whose host KV was protected
    _top: TreeNode = field(repr=False)  # first node above the protected range (exclusive)
    _state_node: TreeNode | None = field(repr=False)


@dataclass(frozen=True, eq=False, slots=True)
class LoadOp:
    """Host -> device copy order: host_pages[i] -> device_pages[i], host_states[i] -> device_states[i].

    The host side stays protected until `RadixTree.load_back_done(op)`."""

    op_id: int
    device_pages: list[int]
    host_pages: list[int]
    device_states: list[int]
    host_states: list[int]
    node: TreeNode
    backups: list[BackupOp]  # write_back orders issued while making room: send them BEFORE this load
    _bottom: TreeNode | None = field(repr=False)
    _top: TreeNode = field(repr=False)
    _state_node: TreeNode | None = field(repr=False)
