"""Eviction queues: LRU order, expiry, and the scan-resistant policy's behaviour under a loop."""

from __future__ import annotations

import pytest

from himamba.services.cache.eviction import EXPIRED, LRUQueue, ScanResistantQueue, make_queue


def drain(q) -> list:
    out = []
    while (m := q.pop()) is not None:
        out.append(m)
    return out


def test_lru_pops_least_recent_first_and_touch_reorders():
    q = LRUQueue()
    for i, name in enumerate("abc", start=1):
        q.add(name, i, False, 1)
    q.touch("a", 10)
    q.discard("b")
    assert len(q) == 2 and "b" not in q
    q.check()
    assert drain(q) == ["c", "a"]
    assert q.pop() is None


def test_lru_expired_members_go_first_in_expiry_order():
    q = LRUQueue()
    for i, name in enumerate("abcd", start=1):
        q.add(name, i, False, 1)
    q.touch("c", EXPIRED)
    q.touch("b", EXPIRED)
    assert drain(q) == ["c", "b", "a", "d"]


def test_lru_heap_is_compacted_under_many_touches():
    q = LRUQueue()
    q.add("x", 1, False, 1)
    q.add("y", 2, False, 1)
    for stamp in range(3, 1000):
        q.touch("x", stamp)
    assert len(q._heap) < 100
    q.check()
    assert drain(q) == ["y", "x"]


def test_scan_resistant_evicts_never_hit_members_before_hit_ones():
    q = ScanResistantQueue(seed=1)
    q.add("hot", 1, True, 1)
    for i in range(5):
        q.add(f"cold{i}", 10 + i, False, 1)
    q.check()
    out = drain(q)
    assert out[-1] == "hot"
    assert sorted(out[:-1]) == [f"cold{i}" for i in range(5)]


def test_scan_resistant_touch_with_a_hit_protects_a_member():
    q = ScanResistantQueue(seed=0)
    q.add("a", 1, False, 1)
    q.add("b", 2, False, 1)
    q.touch("a", 3, True)
    assert drain(q) == ["b", "a"]


def test_scan_resistant_protected_share_bounds_the_hot_segment():
    # Protected holds 10 of 11 weight units, more than its 0.5 share: the LRU protected member goes first.
    q = ScanResistantQueue(seed=0, protected_share=0.5)
    q.add("old_hot", 1, True, 5)
    q.add("new_hot", 2, True, 5)
    q.add("cold", 3, False, 1)
    assert q.pop() == "old_hot"
    q.set_weight("new_hot", 1)  # now 1 of 2 units: within the share, probation goes first
    assert q.pop() == "cold"
    q.check()


def test_scan_resistant_expired_first():
    q = ScanResistantQueue(seed=0)
    q.add("hot", 1, True, 1)
    q.add("cold", 2, False, 1)
    q.add("gone", EXPIRED, True, 1)
    q.touch("hot", EXPIRED)
    assert drain(q)[:2] == ["gone", "hot"]


def _loop_hits(q, num_items: int, capacity: int, rounds: int) -> int:
    """A cyclic access pattern over more items than fit: hit -> touch(warm), miss -> insert (evict first)."""
    cached: set[int] = set()
    hits = 0
    stamp = 0
    for _ in range(rounds):
        for item in range(num_items):
            stamp += 1
            if item in cached:
                hits += 1
                q.touch(item, stamp, True)
                continue
            if len(cached) >= capacity:
                cached.discard(q.pop())
            q.add(item, stamp, False, 1)
            cached.add(item)
    return hits


def test_lru_caches_nothing_under_a_loop_larger_than_the_cache_but_scan_resistant_does():
    assert _loop_hits(make_queue("lru"), 40, 30, 10) == 0
    hits = _loop_hits(make_queue("scan_resistant", seed=3), 40, 30, 10)
    assert hits > 40 * 9 * 0.4  # far from LRU's zero; at most 30 of 40 items per round can hit


def test_make_queue_rejects_unknown_policy():
    with pytest.raises(ValueError, match="eviction_policy"):
        make_queue("mru")


def test_check_detects_corruption():
    q = ScanResistantQueue()
    q.add("a", 1, False, 1)
    q._total_weight += 1
    with pytest.raises(AssertionError):
        q.check()


def test_reweighing_an_expired_member_leaves_the_protected_weight_alone():
    q = ScanResistantQueue()
    q.add("hot", 1, warm=True, weight=2)
    q.add("gone", EXPIRED, weight=3)
    q.set_weight("gone", 5)
    q.check()  # the protected weight counts the hot member alone
    assert q.pop() == "gone" and q.pop() == "hot" and q.pop() is None
    q.check()
