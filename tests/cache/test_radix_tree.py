"""Radix tree unit tests: matching, insert/dedup, lock receipts, eviction, write policies, transfers.

Each test pins one behaviour (several are sglang bugs our design must make impossible; the issue
numbers are in the test names' docstrings). `check_invariants()` runs at the end of most tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from himamba.services.cache.allocator import PageAllocator, SlotAllocator
from himamba.services.cache.tree.node import TreeNode
from himamba.services.cache.tree.radix_tree import RadixTree


@dataclass
class Env:
    tree: RadixTree
    kv: PageAllocator
    st: SlotAllocator
    hkv: PageAllocator | None
    hst: SlotAllocator | None

    def put(self, tokens, state: bool = True):
        """Insert fully computed tokens (fresh pages, and a fresh state slot if asked)."""
        ps = self.tree.page_size
        pages = self.kv.alloc(len(tokens) // ps)
        assert pages is not None
        slot = self.st.alloc(1)[0] if state else None
        return self.tree.insert(tuple(tokens), pages, slot)

    def ack(self, ops):
        for op in ops:
            self.tree.backup_done(op)

    def check(self, **external):
        self.tree.check_invariants(**external)


def make(page_size=1, pages=32, slots=8, host_pages=0, host_slots=0, **kw) -> Env:
    kv, st = PageAllocator(pages), SlotAllocator(slots)
    hkv = PageAllocator(host_pages) if host_pages else None
    hst = SlotAllocator(host_slots) if host_slots else None
    return Env(RadixTree(page_size, kv, st, hkv, hst, **kw), kv, st, hkv, hst)


def path(node: TreeNode) -> tuple[int, ...]:
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return tuple(t for p in reversed(parts) for t in p)


# ---------------------------------------------------------------------- match


def test_match_returns_deepest_state_node_with_kv_match_beyond_it():
    e = make()
    e.put([1, 2, 3, 4])
    e.put([1, 2, 3, 4, 5, 6, 7, 8], state=False)  # KV past the state, no checkpoint there
    m = e.tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert path(m.node) == (1, 2, 3, 4) and m.cached_len == 4
    assert m.kv_match_len == 8
    assert m.state_tier == "device" and m.device_len == 4 and m.host_len == 0
    assert len(m.device_pages) == 4
    assert m.device_node is m.node and m.device_cached_len == 4
    e.check()


def test_match_with_no_state_anywhere_is_a_miss_even_with_kv():
    e = make()
    e.put([1, 2, 3], state=False)
    m = e.tree.match_prefix([1, 2, 3, 4])
    assert m.node is e.tree.root and m.cached_len == 0 and m.state_tier == "none"
    assert m.kv_match_len == 3 and m.device_pages == []


def test_match_uses_whole_pages_only():
    e = make(page_size=4)
    e.put(range(8))
    m = e.tree.match_prefix(range(7))  # 1 whole page + 3 tokens: the node ends at 8, out of reach
    assert m.cached_len == 0 and m.kv_match_len == 4
    m = e.tree.match_prefix(range(9))
    assert m.cached_len == 8 and len(m.device_pages) == 2


def test_exact_boundary_prompt_never_reuses_a_state_that_includes_its_last_token():
    """vllm#51094: a prompt whose length is exactly a cached state boundary must recompute its last
    token, so the caller matches prompt[:-1] and gets the previous page's state only."""
    e = make(page_size=4)
    e.put(range(4))
    e.put(range(8))
    prompt = tuple(range(8))
    m = e.tree.match_prefix(prompt[:-1])
    assert m.cached_len == 4 and path(m.node) == tuple(range(4))


def test_match_splits_a_node_where_the_match_ends_inside_it():
    e = make(page_size=2)
    e.put([1, 2, 3, 4, 5, 6])
    m = e.tree.match_prefix([1, 2, 3, 4, 9, 9])
    assert m.kv_match_len == 4 and m.cached_len == 0
    upper = e.tree.root.children[(1, 2)]
    assert upper.key == (1, 2, 3, 4) and upper.device_state is None and len(upper.device_pages) == 2
    lower = upper.children[(5, 6)]
    assert lower.key == (5, 6) and lower.device_state is not None and len(lower.device_pages) == 1
    assert e.tree.usage().nodes == 3
    e.check()


def test_match_refreshes_only_the_consumed_state():
    """sglang#31643: touching every state on the path keeps dead ancestors alive; touch only the used one."""
    e = make()
    a = e.put([1, 2]).node
    b = e.put([1, 2, 3, 4]).node
    before = a.state_access
    e.tree.match_prefix([1, 2, 3, 4, 5])
    assert a.state_access == before
    assert b.state_access > before
    assert a.last_access == b.last_access  # KV recency covers the whole path


# ---------------------------------------------------------------------- insert


def test_insert_frees_duplicate_pages_and_returns_the_tree_pages():
    e = make()
    first = e.put([1, 2, 3, 4])
    free_before = e.kv.num_free
    mine = e.kv.alloc(5)
    res = e.tree.insert((1, 2, 3, 4, 5), mine, None)
    assert res.pages == first.pages + [mine[4]]
    assert res.num_dup_freed == 4
    assert e.kv.num_free == free_before - 1  # only the new page stayed allocated
    e.check()


def test_insert_never_frees_pages_that_are_the_trees_own():
    e = make()
    first = e.put([1, 2, 3])
    extra = e.kv.alloc(2)
    # The caller re-uses the tree's first page, and has its own copy of the second and third.
    res = e.tree.insert((1, 2, 3, 4), [first.pages[0], extra[0], first.pages[2], extra[1]], None)
    assert res.pages == first.pages + [extra[1]]
    assert res.num_dup_freed == 1
    assert not e.kv.is_free(first.pages[0]) and e.kv.is_free(extra[0])
    e.check()


def test_insert_revives_a_host_only_node_with_the_callers_pages():
    e = make(pages=8, slots=4, host_pages=16, host_slots=4)
    res = e.put([1, 2, 3])
    e.ack(res.backups)
    e.tree.evict(3)
    node = res.node
    assert node.device_pages is None and node.host_pages is not None
    mine = e.kv.alloc(3)
    again = e.tree.insert((1, 2, 3), mine, None)
    assert again.node is node and node.device_pages == mine and again.num_dup_freed == 0
    assert node.host_pages is not None  # the host copy stays: no new backup is needed
    assert again.backups == []
    e.check()


def test_insert_state_on_a_node_that_has_one_frees_the_given_slot():
    e = make()
    first = e.put([1, 2])
    own_slot = first.node.device_state
    slot = e.st.alloc(1)[0]
    pages = e.kv.alloc(2)
    res = e.tree.insert((1, 2), pages, slot)
    assert not res.state_used and e.st.is_free(slot)
    assert first.node.device_state == own_slot
    # Handing back the tree's own slot is not a duplicate: nothing is freed.
    res = e.tree.insert((1, 2), first.pages, own_slot)
    assert res.state_used and not e.st.is_free(own_slot) and res.num_dup_freed == 0
    e.check()


def test_insert_attaches_a_state_to_a_stateless_node():
    e = make()
    node = e.put([1, 2, 3], state=False).node
    slot = e.st.alloc(1)[0]
    res = e.tree.insert((1, 2, 3), list(node.device_pages), slot)
    assert res.state_used and node.device_state == slot
    assert e.tree.match_prefix([1, 2, 3, 4]).cached_len == 3


def test_insert_in_the_middle_of_a_node_splits_it_and_puts_the_state_at_the_exact_end():
    e = make(page_size=2)
    long = e.put([1, 2, 3, 4, 5, 6]).node
    slot = e.st.alloc(1)[0]
    res = e.tree.insert((1, 2, 3, 4), e.kv.alloc(2), slot)
    assert res.state_used and path(res.node) == (1, 2, 3, 4) and res.node.device_state == slot
    assert res.node.children[(5, 6)] is long
    assert res.num_dup_freed == 2
    e.check()


@pytest.mark.parametrize(
    "tokens, pages, locked, field",
    [
        ((1, 2, 3), [0], 0, "tokens"),  # not whole pages
        ((1, 2), [0, 1], 0, "device_pages"),  # 2 pages for 1 page of tokens
        ((1, 2, 3, 4), [0, 1], 1, "locked_prefix_len"),  # not a page multiple
        ((1, 2, 3, 4), [0, 1], 6, "locked_prefix_len"),  # longer than the tokens
    ],
)
def test_insert_rejects_bad_input_naming_the_field(tokens, pages, locked, field):
    e = make(page_size=2)
    with pytest.raises(ValueError, match=field):
        e.tree.insert(tokens, pages, None, locked)
    assert e.tree.usage().nodes == 1


def test_insert_rejects_a_locked_prefix_that_is_not_the_trees():
    e = make()
    res = e.put([1, 2, 3])
    other = e.kv.alloc(3)
    with pytest.raises(ValueError, match="device_pages"):
        e.tree.insert((1, 2, 3, 4), other + e.kv.alloc(1), None, locked_prefix_len=2)
    with pytest.raises(ValueError, match="locked_prefix_len"):
        e.tree.insert((7, 8), e.kv.alloc(2), None, locked_prefix_len=2)
    assert res.node.device_pages == res.pages  # nothing was changed by the rejected calls


# ---------------------------------------------------------------------- locks


def test_lock_covers_path_and_state_and_unlock_releases_exactly():
    e = make()
    a = e.put([1, 2]).node
    b = e.put([1, 2, 3, 4]).node
    r = e.tree.lock(b)
    assert (a.lock_ref, b.lock_ref, b.mamba_lock_ref, a.mamba_lock_ref) == (1, 1, 1, 0)
    assert e.tree.usage().device_pages_protected == 4 and e.tree.usage().device_states_protected == 1
    e.check()
    e.tree.unlock(r)
    assert (a.lock_ref, b.lock_ref, b.mamba_lock_ref) == (0, 0, 0)
    assert e.tree.usage().device_pages_protected == 0 and e.tree.usage().device_states_protected == 0
    with pytest.raises(ValueError, match="receipt"):
        e.tree.unlock(r)
    e.check()


def test_lock_receipt_survives_a_split_of_the_locked_node():
    e = make()
    node = e.put([1, 2, 3, 4, 5, 6]).node
    r = e.tree.lock(node)
    e.tree.match_prefix([1, 2, 3, 9])  # splits the locked node: (1, 2, 3) + (4, 5, 6)
    upper = node.parent
    assert upper.key == (1, 2, 3) and upper.lock_ref == 1 and node.lock_ref == 1
    e.check()
    e.tree.unlock(r)
    assert upper.lock_ref == 0 and node.lock_ref == 0 and node.mamba_lock_ref == 0
    assert e.tree.usage().device_pages_protected == 0
    e.check()


def test_state_appearing_between_lock_and_unlock_does_not_unbalance_counters():
    """sglang#27147: lock skipped the absent state; it then appeared; unlock must not release it."""
    e = make()
    node = e.put([1, 2, 3], state=False).node
    r = e.tree.lock(node)
    assert r.state_node is None
    slot = e.st.alloc(1)[0]
    e.tree.insert((1, 2, 3), list(node.device_pages), slot)
    assert node.device_state == slot and node.mamba_lock_ref == 0
    e.tree.unlock(r)
    assert node.mamba_lock_ref == 0 and e.tree.usage().device_states_protected == 0
    e.check()


def test_state_vanishing_between_lock_and_unlock_does_not_unbalance_counters():
    """sglang#21379 + #27147: the KV is locked but the state is not; state eviction may drop it
    (never the locked KV) and the unlock still balances."""
    e = make()
    node = e.put([1, 2, 3], state=False).node
    r = e.tree.lock(node)
    slot = e.st.alloc(1)[0]
    e.tree.insert((1, 2, 3), list(node.device_pages), slot)
    res = e.tree.evict_state(1)
    assert res.num_states == 1 and res.num_pages == 0
    assert node.device_state is None and node.device_pages is not None
    e.tree.unlock(r)
    e.check()


def test_eviction_skips_locked_nodes_and_reports_nothing_evictable():
    e = make()
    node = e.put([1, 2, 3]).node
    r = e.tree.lock(node)
    for res in (e.tree.evict(10), e.tree.evict_state(10), e.tree.evict_host(10), e.tree.evict_host_state(10)):
        assert res[:4] == (0, 0, 0, 0) and res.backups == []
    assert node.device_pages is not None and node.device_state is not None
    e.tree.unlock(r)
    assert e.tree.evict(10).num_pages == 3
    assert e.tree.usage().nodes == 1 and e.kv.num_free == e.kv.capacity
    e.check()


def test_lock_on_a_deleted_node_is_rejected():
    e = make()
    node = e.put([1, 2]).node
    e.tree.evict(2)
    assert not node.is_attached
    with pytest.raises(ValueError, match="node"):
        e.tree.lock(node)


# ---------------------------------------------------------------------- eviction


def test_state_eviction_on_an_internal_node_keeps_its_kv():
    e = make()
    a = e.put([1, 2]).node
    b = e.put([1, 2, 3, 4]).node
    res = e.tree.evict_state(1)
    assert res.num_states == 1 and res.num_pages == 0
    assert a.device_state is None and a.device_pages is not None
    assert b.device_state is not None
    e.check()


def test_state_eviction_on_an_unlocked_leaf_evicts_it_entirely():
    e = make()
    node = e.put([1, 2]).node
    res = e.tree.evict_state(1)
    assert res.num_states == 1 and res.num_pages == 2
    assert not node.is_attached
    e.check()


def test_write_through_eviction_deletes_unbacked_leaves_and_their_dead_ancestors():
    e = make(write_policy="write_through")
    e.put([1, 2], state=False)
    leaf = e.put([1, 2, 3, 4]).node
    res = e.tree.evict(1)
    # The stateless parent (1, 2) is childless afterwards and can never be a hit: deleted too.
    assert res.num_pages == 4 and e.tree.usage().nodes == 1 and not leaf.is_attached
    e.check()


def test_cascade_deletion_stops_at_a_node_with_a_pending_host_transfer():
    """sglang#22592/#23696: the cascade ignored host refs and deleted a node a transfer still used."""
    e = make(host_pages=16, host_slots=4, write_policy="write_through_selective")
    parent = e.put([1, 2], state=False).node
    op = e.tree.backup(parent)
    assert op is not None and parent.host_ref == 1
    leaf = e.put([1, 2, 3, 4]).node  # selective: not backed up
    e.tree.evict(1)
    assert not leaf.is_attached
    assert parent.is_attached  # childless and stateless, but host_ref > 0
    e.check()
    e.tree.backup_done(op)
    e.check()


def test_cascade_deletion_stops_at_a_locked_node():
    e = make()
    parent = e.put([1, 2], state=False).node
    r = e.tree.lock(parent)
    e.put([1, 2, 3, 4])
    e.tree.evict(10)
    assert parent.is_attached and parent.children == {}
    e.tree.unlock(r)
    e.check()


def test_superseded_chain_state_is_evicted_before_other_conversations():
    """A turn's state consumed by the next turn (which inserts a deeper one) is dead weight."""
    e = make(slots=8)
    b1 = e.put([7, 7]).node  # conversation B, older
    a1 = e.put([1, 2]).node
    m = e.tree.match_prefix([1, 2, 3])
    assert m.node is a1
    e.put([1, 2, 3, 4])  # conversation A moves on
    e.tree.evict_state(1)
    assert a1.device_state is None and b1.device_state is not None


def test_a_shared_state_at_a_branch_point_is_not_superseded():
    e = make(slots=8)
    old = e.put([7, 7]).node
    sys_prompt = e.put([1, 2]).node
    e.put([1, 2, 3, 3])
    e.tree.match_prefix([1, 2, 5])
    e.put([1, 2, 5, 5])  # second branch under the shared prefix
    e.tree.evict_state(1)
    assert sys_prompt.device_state is not None and old.device_state is None


# ---------------------------------------------------------------------- dual host counters


def test_release_below_zero_raises_naming_node_and_counter():
    node = TreeNode(5, (1,), None)
    with pytest.raises(RuntimeError, match="node 5: host_ref"):
        node.release_host()
    with pytest.raises(RuntimeError, match="node 5: host_mamba_ref"):
        node.release_host_mamba()


def _host_only_leaf(e: Env) -> TreeNode:
    res = e.put([1, 2, 3])
    e.ack(res.backups)
    e.tree.evict(3)
    node = res.node
    assert node.device_pages is None and node.host_pages is not None and node.host_state is not None
    return node


def test_protected_host_state_is_neither_host_evictable_nor_in_the_host_state_lru():
    e = make(host_pages=16, host_slots=4)
    node = _host_only_leaf(e)
    pin = e.tree.protect_host(node, kv=False, state=True)
    assert node.host_ref == 0 and node.host_mamba_ref == 1
    assert node not in e.tree._host_states and node not in e.tree._host_leaves
    assert e.tree.evict_host(100).num_host_pages == 0
    assert e.tree.evict_host_state(100).num_host_states == 0
    assert node.host_state is not None
    e.check()
    e.tree.release_host(pin)
    assert node in e.tree._host_states and node in e.tree._host_leaves
    assert e.tree.evict_host_state(1).num_host_states == 1 and not node.is_attached
    e.check()


def test_releasing_kv_only_leaves_the_mamba_counter_alone():
    e = make(host_pages=16, host_slots=4)
    node = _host_only_leaf(e)
    state_pin = e.tree.protect_host(node, kv=False, state=True)
    kv_pin = e.tree.protect_host(node, kv=True)
    e.tree.release_host(kv_pin)
    assert node.host_ref == 0 and node.host_mamba_ref == 1
    with pytest.raises(ValueError, match="pin"):
        e.tree.release_host(kv_pin)
    e.tree.release_host(state_pin)
    with pytest.raises(RuntimeError, match="host_mamba_ref"):
        node.release_host_mamba()
    e.check()


def test_a_kv_only_backup_does_not_touch_the_mamba_counter():
    e = make(host_pages=16, host_slots=4, write_policy="write_through_selective")
    node = e.put([1, 2], state=False).node
    op = e.tree.backup(node)
    assert op.host_states == [] and node.host_ref == 1 and node.host_mamba_ref == 0
    e.tree.backup_done(op)
    assert node.host_ref == 0 and node.host_mamba_ref == 0
    with pytest.raises(ValueError, match="op"):
        e.tree.backup_done(op)
    e.check()


def test_host_pin_survives_a_split():
    e = make(host_pages=16, host_slots=4)
    node = _host_only_leaf(e)
    pin = e.tree.protect_host(node, kv=True, state=True)
    e.tree.match_prefix([1, 9])  # splits the host-only node
    upper = node.parent
    assert upper.key == (1,) and upper.host_ref == 1 and node.host_ref == 1
    e.tree.release_host(pin)
    assert upper.host_ref == 0 and node.host_ref == 0 and node.host_mamba_ref == 0
    e.check()


# ---------------------------------------------------------------------- write policies and transfers


def test_write_through_backs_up_on_insert_with_the_state():
    e = make(host_pages=16, host_slots=4, write_policy="write_through")
    res = e.put([1, 2, 3])
    (op,) = res.backups
    assert op.device_pages == res.pages and len(op.host_pages) == 3
    assert op.device_states == [res.node.device_state] and op.host_states == [res.node.host_state]
    assert res.node.host_ref == 1 and res.node.host_mamba_ref == 1
    assert e.tree.usage().host_pages_protected == 3 and e.tree.usage().host_states_protected == 1
    e.check()
    e.tree.backup_done(op)
    assert e.tree.usage().host_pages_protected == 0 and e.tree.usage().host_states_protected == 0
    e.check()


def test_write_through_selective_backs_up_after_the_threshold_of_hits():
    e = make(host_pages=16, host_slots=4, write_policy="write_through_selective", selective_threshold=2)
    res = e.put([1, 2, 3])
    assert res.backups == []
    assert e.tree.match_prefix([1, 2, 3, 4]).backups == []
    (op,) = e.tree.match_prefix([1, 2, 3, 4]).backups
    assert res.node.host_pages is not None and op.host_states
    e.ack([op])
    assert e.tree.match_prefix([1, 2, 3, 4]).backups == []  # already on host
    e.check()


def test_write_back_backs_up_on_eviction_and_demotes():
    e = make(host_pages=16, host_slots=4, write_policy="write_back")
    res = e.put([1, 2, 3])
    assert res.backups == []
    ev = e.tree.evict(1)
    (op,) = ev.backups
    assert ev.num_pages == 3 and ev.num_states == 1
    node = res.node
    assert node.is_attached and node.device_pages is None and node.host_pages is not None
    assert op.device_pages == res.pages  # copied before those pages are reused
    e.check()
    e.ack(ev.backups)
    m = e.tree.match_prefix([1, 2, 3, 4])
    assert m.state_tier == "host" and m.host_len == 3 and m.device_len == 0
    e.check()


def test_no_host_tier_means_eviction_deletes():
    e = make(write_policy="write_back")
    res = e.put([1, 2])
    ev = e.tree.evict(2)
    assert ev.backups == [] and not res.node.is_attached


def test_backup_of_a_deep_node_covers_its_unbacked_ancestors_in_one_op():
    """sglang bug #22: a deep node waited for its parents' acks; one op covers the whole path."""
    e = make(host_pages=32, host_slots=4, write_policy="write_through_selective")
    a = e.put([1, 2], state=False).node
    b = e.put([1, 2, 3, 4], state=False).node
    c = e.put([1, 2, 3, 4, 5, 6]).node
    op = e.tree.backup(c)
    assert len(op.device_pages) == len(op.host_pages) == 6
    assert op.device_pages == a.device_pages + b.device_pages + c.device_pages
    assert op.host_pages == a.host_pages + b.host_pages + c.host_pages
    assert (a.host_ref, b.host_ref, c.host_ref, c.host_mamba_ref) == (1, 1, 1, 1)
    e.tree.match_prefix([1, 3])  # a split inside the op's range while it is pending
    e.check()
    e.tree.backup_done(op)
    assert (a.host_ref, b.host_ref, c.host_ref, c.host_mamba_ref) == (0, 0, 0, 0)
    assert a.parent.host_ref == 0
    assert e.tree.backup(c) is None  # nothing left to copy
    e.check()


def test_backup_without_host_memory_returns_none():
    e = make(host_pages=2, host_slots=1, write_policy="write_through_selective")
    node = e.put([1, 2, 3]).node
    assert e.tree.backup(node) is None
    assert node.host_pages is None and e.hkv.num_free == 2
    e.check()


def test_load_back_restores_kv_and_state_and_protects_the_host_side_until_done():
    e = make(pages=8, slots=4, host_pages=16, host_slots=4)
    res = e.put([1, 2, 3])
    e.ack(res.backups)
    node = res.node
    e.tree.evict(3)
    m = e.tree.match_prefix([1, 2, 3, 4])
    assert m.state_tier == "host" and m.host_len == 3 and m.device_node is e.tree.root
    op = e.tree.load_back(m.node)
    assert op.host_pages == node.host_pages and op.device_pages == node.device_pages
    assert op.device_states == [node.device_state] and op.host_states == [node.host_state]
    assert node.host_ref == 1 and node.host_mamba_ref == 1
    e.check()
    e.tree.load_back_done(op)
    assert node.host_ref == 0 and node.host_mamba_ref == 0
    m = e.tree.match_prefix([1, 2, 3, 4])
    assert m.state_tier == "device" and m.device_len == 3
    assert e.tree.load_back(node) is None  # nothing left to load
    e.check()


def test_load_back_that_cannot_get_device_memory_changes_nothing():
    e = make(pages=4, slots=4, host_pages=16, host_slots=4)
    res = e.put([1, 2, 3])
    e.ack(res.backups)
    e.tree.evict(3)
    blocker = e.put([5, 6, 7])
    r = e.tree.lock(blocker.node)  # 3 of 4 device pages locked: the 3-page load cannot fit
    before = (e.kv.num_free, e.tree.usage().device_pages_used, res.node.host_ref)
    assert e.tree.load_back(res.node) is None
    assert (e.kv.num_free, e.tree.usage().device_pages_used, res.node.host_ref) == before
    assert res.node.device_pages is None and blocker.node.device_pages is not None
    e.tree.unlock(r)
    e.check()


def test_load_back_under_write_back_returns_the_backups_of_the_room_it_made():
    e = make(pages=4, slots=4, host_pages=16, host_slots=4, write_policy="write_back")
    first = e.put([1, 2, 3])
    e.ack(e.tree.evict(3).backups)
    e.put([5, 6, 7])  # fills the device, not backed up (write_back)
    op = e.tree.load_back(first.node)
    assert op is not None and len(op.backups) == 1
    assert set(op.backups[0].device_pages) & set(op.device_pages)  # freed pages reused by the load
    e.check()
    e.ack(op.backups)
    e.tree.load_back_done(op)
    e.check()


# ---------------------------------------------------------------------- checker and metrics


def test_check_invariants_catches_corruption():
    e = make()
    node = e.put([1, 2, 3]).node
    e.check()
    with pytest.raises(AssertionError, match="external device page"):
        e.check(external_device_pages=[node.device_pages[0]])
    e.tree._dev_pages_protected += 1
    with pytest.raises(AssertionError, match="device_pages_protected"):
        e.check()
    e.tree._dev_pages_protected -= 1
    node.lock_ref = 1
    with pytest.raises(AssertionError, match=f"node {node.id}"):
        e.check()
    node.lock_ref = 0
    stray = e.kv.alloc(1)
    with pytest.raises(AssertionError, match="nobody"):
        e.check()
    e.check(external_device_pages=stray)


def test_metric_counters_follow_locks_and_tiers():
    e = make(host_pages=16, host_slots=4)
    res = e.put([1, 2, 3])
    t = e.tree
    u = t.usage()
    assert (u.device_pages_used, u.device_pages_evictable, u.device_states_used) == (3, 3, 1)
    assert (u.host_pages_used, u.host_pages_protected, u.host_states_protected) == (3, 3, 1)
    e.ack(res.backups)
    r = t.lock(res.node)
    u = t.usage()
    assert (u.device_pages_protected, u.device_states_protected, u.device_states_evictable) == (3, 1, 0)
    t.unlock(r)
    u = t.usage()
    assert (u.host_pages_evictable, u.host_states_evictable) == (3, 1)
    assert (u.nodes, u.pending_backups, u.pending_loads, u.taints) == (2, 0, 0, 0)


def test_constructor_validates_its_arguments():
    kv, st = PageAllocator(4), SlotAllocator(2)
    for kwargs, field in (
        (dict(page_size=0), "page_size"),
        (dict(write_policy="sometimes"), "write_policy"),
        (dict(eviction_policy="mru"), "eviction_policy"),
        (dict(selective_threshold=0), "selective_threshold"),
        (dict(host_state=SlotAllocator(2)), "host_state"),
    ):
        args = dict(page_size=1, device_kv=kv, device_state=st) | kwargs
        with pytest.raises(ValueError, match=field):
            RadixTree(**args)


def test_host_eviction_never_frees_device_memory():
    e = make(host_pages=16, host_slots=4)
    parent = e.put([1, 2], state=False)
    e.ack(parent.backups)
    child = e.put([1, 2, 3, 4])
    e.ack(child.backups)
    e.tree.evict(1)  # the only device leaf is the child: demoted, the parent stays on device
    assert child.node.device_pages is None and parent.node.device_pages is not None
    free_before = e.kv.num_free
    res = e.tree.evict_host(100)  # the host-only child, then the parent's mirror
    assert res.num_host_pages == 4 and res.num_pages == 0 and e.kv.num_free == free_before
    assert not child.node.is_attached
    assert parent.node.is_attached and parent.node.device_pages == parent.pages  # dead but left to device eviction
    assert parent.node.host_pages is None
    e.check()
    assert e.tree.evict(10).num_pages == 2
    e.check()


def test_write_back_eviction_whose_backup_evicts_the_nodes_last_child():
    """The state-only backup of a node being evicted evicts its host-only child to get a host slot;
    the node must still leave the device-leaf queue when demoted (found by the state machine)."""
    e = make(host_pages=8, host_slots=1, write_policy="write_back")
    parent = e.put([1, 2]).node
    child = e.put([1, 2, 3, 4]).node
    e.ack([e.tree.backup(child)])  # host KV of both, the only host slot holds the child's state
    e.ack(e.tree.evict(2).backups)  # demotes the child
    assert child.device_pages is None and parent.device_pages is not None
    ev = e.tree.evict(2)  # parent: its state needs the host slot -> the child is host-evicted
    e.ack(ev.backups)
    assert not child.is_attached
    assert parent.device_pages is None and parent.host_state is not None
    e.check()


# ---------------------------------------------------------------------- host mirrors (sglang #33862)


def _chain(e: Env, *lengths: int) -> list[TreeNode]:
    """Insert a chain of prefixes 1..n under write_through and acknowledge the backups."""
    nodes = []
    for n in lengths:
        res = e.put(list(range(1, n + 1)))
        e.ack(res.backups)
        nodes.append(res.node)
    return nodes


def test_host_eviction_drops_mirrors_of_device_nodes_deepest_first():
    """write_through fills the host pool with copies of device nodes; host eviction must be able to
    free them (sglang #33862), one node at a time from the bottom, leaving every node on device."""
    e = make(pages=16, host_pages=6, host_slots=4)
    a, b, c = _chain(e, 2, 4, 6)
    assert e.hkv.num_free == 0 and e.tree.usage().host_pages_evictable == 6
    dev = {n: list(n.device_pages) for n in (a, b, c)}
    res = e.tree.evict_host(1)
    assert (res.num_host_pages, res.num_host_states, res.num_pages, res.num_states) == (2, 1, 0, 0)
    assert c.host_pages is None and c.host_state is None and b.host_pages is not None
    e.check()
    assert e.tree.evict_host(2).num_host_pages == 2 and b.host_pages is None and a.host_pages is not None
    e.check()
    assert e.tree.evict_host(100).num_host_pages == 2
    assert e.hkv.num_free == 6 and e.hst.num_free == 4 and e.tree.usage().host_pages_evictable == 0
    for n in (a, b, c):
        assert n.is_attached and n.device_pages == dev[n] and n.device_state is not None
    m = e.tree.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert m.node is c and m.state_tier == "device" and m.device_pages == dev[a] + dev[b] + dev[c]
    e.check()


def test_host_eviction_prefers_host_only_leaves_then_mirrors_in_lru_order():
    e = make(pages=8, host_pages=8, host_slots=4)
    (z,) = _chain(e, 2)
    x = e.put([11, 12])
    y = e.put([21, 22])
    e.ack(x.backups + y.backups)
    e.tree.evict(2)  # z is the least recently used device leaf: demoted, host-only
    assert z.device_pages is None and z.host_pages is not None
    e.tree.match_prefix([11, 12, 13])  # x becomes the most recently used mirror
    assert e.tree.evict_host(2).num_host_pages == 2 and not z.is_attached
    assert x.node.host_pages is not None and y.node.host_pages is not None
    assert e.tree.evict_host(2).num_host_pages == 2
    assert y.node.host_pages is None and x.node.host_pages is not None and y.node.device_pages is not None
    e.check()


def test_pinned_mirrors_and_their_ancestors_are_not_host_evictable():
    e = make(pages=16, host_pages=12, host_slots=4)
    a, b = _chain(e, 2, 4)
    side = e.put([1, 2, 9, 9])  # a sibling of b under a
    e.ack(side.backups)
    other = e.put([5, 6])
    e.ack(other.backups)
    pin = e.tree.protect_host(b, kv=True)
    # a and b are held (b pinned, a above it): only side and other are freeable.
    assert e.tree.usage().host_pages_protected == 4 and e.tree.usage().host_pages_evictable == 4
    e.check()
    res = e.tree.evict_host(100)
    assert res.num_host_pages == 4 and e.tree.usage().host_pages_evictable == 0
    assert side.node.host_pages is None and other.node.host_pages is None
    assert a.host_pages is not None and b.host_pages is not None
    e.check()
    e.tree.release_host(pin)
    state_pin = e.tree.protect_host(b, kv=False, state=True)  # a state pin holds the KV too
    assert e.tree.evict_host(100).num_host_pages == 0
    e.tree.release_host(state_pin)
    assert e.tree.usage().host_pages_evictable == 4 and e.tree.evict_host(100).num_host_pages == 4
    assert a.device_pages is not None and b.device_pages is not None
    e.check()


def test_a_pending_backup_holds_its_path_against_host_eviction():
    e = make(pages=16, host_pages=16, host_slots=4)
    _chain(e, 2)
    res = e.put([1, 2, 3, 4])  # its backup is pending: [3, 4] pinned, [1, 2] held above it
    assert e.tree.usage().host_pages_protected == 4 and e.tree.evict_host(100).num_host_pages == 0
    e.ack(res.backups)
    assert e.tree.usage().host_pages_protected == 0 and e.tree.evict_host(100).num_host_pages == 4
    e.check()


def test_backup_refused_for_a_host_pool_full_of_mirrors_now_succeeds():
    e = make(pages=16, host_pages=4, host_slots=1)
    (old,) = _chain(e, 4)
    assert e.hkv.num_free == 0 and e.hst.num_free == 0
    new = e.put([7, 8])
    (op,) = new.backups  # the old tree returned no backup here: the mirror could not be evicted
    assert len(op.host_pages) == 2 and len(op.host_states) == 1
    assert old.host_pages is None and old.host_state is None
    assert old.device_pages is not None and old.device_state is not None
    e.ack([op])
    assert e.tree.match_prefix([1, 2, 3, 4, 5]).node is old
    e.check()


def test_backup_keeps_the_mirror_its_copies_hang_from():
    """The deepest host node of the path being backed up is a mirror; the host eviction that makes
    room must not drop it, or the new copy would hang below a node off host (host KV is top-closed)."""
    e = make(pages=16, host_pages=4, host_slots=4)
    a, b = _chain(e, 2, 4)
    c = e.put([1, 2, 3, 4, 5, 6])
    assert c.backups == []  # b is kept and a is above it: nothing else to free
    assert a.host_pages is not None and b.host_pages is not None and c.node.host_pages is None
    e.check()
    x = e.put([7, 8])  # x's copy hangs from the root: b, the deepest mirror, makes room
    assert len(x.backups) == 1 and b.host_pages is None and a.host_pages is not None
    e.ack(x.backups)
    e.check()


def test_host_state_eviction_drops_only_the_state_of_a_mirror():
    e = make(pages=16, host_pages=16, host_slots=4)
    (a,) = _chain(e, 2)
    res = e.tree.evict_host_state(1)
    assert res.num_host_states == 1 and res.num_host_pages == 0
    assert a.host_state is None and a.host_pages is not None and a.device_state is not None
    e.check()


@pytest.mark.parametrize("policy", ["lru", "scan_resistant"])
def test_a_locked_leaf_that_loses_its_state_goes_first_once_unlocked(policy):
    """evict_state on a locked leaf leaves its KV without a state, which no hit can use: once
    unlocked it is the first leaf evicted, ahead of older leaves that still serve hits."""
    e = make(eviction_policy=policy)
    a = e.put([1, 2, 3]).node  # older, keeps its state
    b = e.put([5, 6, 7]).node
    ra = e.tree.lock(a)  # with its state: evict_state cannot take it
    rb = e.tree.lock(b, state=False)
    res = e.tree.evict_state(1)
    assert res.num_states == 1 and b.device_state is None and a.device_state is not None
    e.tree.unlock(ra)
    e.tree.unlock(rb)
    e.tree.evict(3)
    assert not b.is_attached and a.is_attached, "the stateless leaf waited for LRU"
    e.check()
