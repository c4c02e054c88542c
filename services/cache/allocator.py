"""Free lists for the four cache pools: device KV pages, device state slots, host KV pages, host state slots.

Pure bookkeeping over integer indices `0 .. capacity-1`; the tensors live elsewhere (worker/pools.py,
the host pool). Every call costs O(number of indices it touches): nothing scans the whole pool.
"""

from __future__ import annotations

from collections.abc import Iterable


class IndexAllocator:
    """A free list of `capacity` integer indices with all-or-nothing allocation.

    `alloc(n)` returns n distinct free indices or None when fewer than n are free (never a partial
    list). `free(indices)` returns indices to the pool and raises ValueError on an index out of range,
    already free, or repeated in the call; the pool is left unchanged when it raises.
    """

    __slots__ = ("_capacity", "_free", "_is_free", "_unit")

    def __init__(self, capacity: int, unit: str = "index") -> None:
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity must be an int >= 0, got {capacity!r}")
        self._capacity = capacity
        self._unit = unit
        # Popped from the end: reversed so that a fresh pool hands out low indices first.
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * capacity

    @property
    def capacity(self) -> int:
        """Total number of indices managed."""
        return self._capacity

    @property
    def num_free(self) -> int:
        """Number of indices currently free."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Number of indices currently allocated."""
        return self._capacity - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """Take `n` free indices, or return None (allocating nothing) when fewer than `n` are free."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        free = self._free
        if n > len(free):
            return None
        if n == 0:
            return []
        out = free[-n:]
        del free[-n:]
        out.reverse()
        is_free = self._is_free
        for i in out:
            is_free[i] = 0
        return out

    def free(self, indices: Iterable[int]) -> None:
        """Return allocated indices to the pool; ValueError (pool unchanged) on a bad or double free."""
        idx = indices if isinstance(indices, list) else list(indices)
        is_free = self._is_free
        cap = self._capacity
        # One pass that checks and marks (a plain loop measured faster than bulk set/itemgetter checks).
        for k, i in enumerate(idx):
            if 0 <= i < cap and not is_free[i]:
                is_free[i] = 1
                continue
            for j in idx[:k]:  # undo, so that a rejected call leaves the pool as it was
                is_free[j] = 0
            if not 0 <= i < cap:
                raise ValueError(f"{self._unit} {i} out of range [0, {cap})")
            raise ValueError(f"{self._unit} {i} is already free (double free)")
        self._free.extend(idx)

    def is_free(self, index: int) -> bool:
        """Whether `index` is currently free."""
        if not (0 <= index < self._capacity):
            raise ValueError(f"{self._unit} {index} out of range [0, {self._capacity})")
        return bool(self._is_free[index])

    def free_indices(self) -> list[int]:
        """A copy of the free list (O(capacity); for checks and tests, not the hot path)."""
        return list(self._free)

    def check(self) -> None:
        """Raise AssertionError if the free list and the free flags disagree (O(capacity))."""
        seen = bytearray(self._capacity)
        for i in self._free:
            if not (0 <= i < self._capacity):
                raise AssertionError(f"{self._unit} {i} in the free list is out of range")
            if seen[i]:
                raise AssertionError(f"{self._unit} {i} is twice in the free list")
            seen[i] = 1
        if seen != self._is_free:
            raise AssertionError(f"{self._unit} free flags disagree with the free list")


class PageAllocator(IndexAllocator):
    """Free list of KV pages (device or host); one index = `page_size` token slots of every attention layer."""

    __slots__ = ()

    def __init__(self, num_pages: int) -> None:
        super().__init__(num_pages, unit="page")


class SlotAllocator(IndexAllocator):
    """Free list of recurrent-state slots (device or host); one index = one whole per-request state."""

    __slots__ = ()

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots, unit="slot")
