"""Page and slot allocators: all-or-nothing allocation, loud bad frees, model-checked with hypothesis."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from himamba.services.cache.allocator import PageAllocator, SlotAllocator

EXAMPLES = int(os.environ.get("HIMAMBA_HYPOTHESIS_EXAMPLES", "60"))


def test_fresh_pool_hands_out_distinct_low_indices():
    a = PageAllocator(8)
    assert a.capacity == 8 and a.num_free == 8
    assert a.alloc(3) == [0, 1, 2]
    assert a.num_free == 5 and a.num_used == 3


def test_alloc_is_all_or_nothing():
    a = SlotAllocator(4)
    got = a.alloc(3)
    assert a.alloc(2) is None
    assert a.num_free == 1  # the failed call took nothing
    assert a.alloc(1) is not None
    assert sorted(got) == [0, 1, 2]


def test_alloc_zero_and_negative():
    a = PageAllocator(2)
    assert a.alloc(0) == []
    with pytest.raises(ValueError, match="n must be"):
        a.alloc(-1)


def test_free_returns_indices_for_reuse():
    a = PageAllocator(3)
    got = a.alloc(3)
    a.free([got[1]])
    assert a.alloc(1) == [got[1]]


@pytest.mark.parametrize(
    "bad, message",
    [([7], "out of range"), ([-1], "out of range"), ([0, 0], "double free"), ([2], "double free")],
)
def test_bad_free_raises_and_leaves_the_pool_unchanged(bad, message):
    a = PageAllocator(4)
    a.alloc(2)  # 0 and 1 in use; 2 and 3 free
    before = (a.num_free, a.free_indices())
    with pytest.raises(ValueError, match=message):
        a.free([1] + bad)  # 1 is valid: the call must be rolled back as a whole
    assert (a.num_free, a.free_indices()) == before
    assert not a.is_free(1)
    a.check()


def test_negative_capacity_rejected():
    with pytest.raises(ValueError, match="capacity"):
        SlotAllocator(-1)


def test_check_detects_a_corrupted_free_list():
    a = PageAllocator(4)
    a.alloc(1)
    a._free.append(a._free[0])  # corrupt on purpose
    with pytest.raises(AssertionError):
        a.check()


ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 6)),
        st.tuples(st.just("free"), st.integers(0, 10**6)),
        st.tuples(st.just("bad_free"), st.integers(0, 10**6)),
    ),
    max_size=60,
)


@settings(max_examples=EXAMPLES, deadline=None, database=None)
@given(capacity=st.integers(0, 16), script=ops, slots=st.booleans())
def test_allocator_matches_a_set_model(capacity, script, slots):
    a = SlotAllocator(capacity) if slots else PageAllocator(capacity)
    used: set[int] = set()
    for op, arg in script:
        if op == "alloc":
            got = a.alloc(arg)
            if arg > capacity - len(used):
                assert got is None
            else:
                assert got is not None and len(got) == arg == len(set(got))
                assert not used & set(got)
                assert all(0 <= i < capacity for i in got)
                used |= set(got)
        elif op == "free" and used:
            ordered = sorted(used)
            k = arg % len(ordered) + 1
            chunk = ordered[:k]
            a.free(chunk)
            used -= set(chunk)
        elif op == "bad_free":
            # Either a free index or an out-of-range one: always rejected, never half-applied.
            free = sorted(set(range(capacity)) - used)
            bad = free[arg % len(free)] if free and arg % 2 else capacity + arg % 3
            with pytest.raises(ValueError):
                a.free(sorted(used)[:1] + [bad])
        assert a.num_free == capacity - len(used)
        assert all(a.is_free(i) == (i not in used) for i in range(capacity))
    a.check()
