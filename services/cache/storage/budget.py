"""The in-flight token budget of prefetches: how many tokens may be travelling storage -> host.

Accounted per job: a job acquires its tokens when admitted and releases exactly those when it
finishes, on every exit path. The capacity has a positive floor, so a mis-sized budget (sglang
computed 0 when host <= device) can slow prefetch but never disable it; and a job is always
admitted when nothing is in flight, so a prefix larger than the budget still makes progress.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

__all__ = ["BudgetState", "TokenBudget"]


class BudgetState(NamedTuple):
    """A snapshot for metrics."""

    capacity_tokens: int
    in_flight_tokens: int
    peak_tokens: int
    num_jobs_in_flight: int
    num_refused: int


class TokenBudget:
    """A thread-safe counter of tokens in flight, capped at max(capacity_tokens, floor_tokens)."""

    def __init__(self, capacity_tokens: int, floor_tokens: int) -> None:
        if floor_tokens <= 0:
            raise ValueError(f"floor_tokens: must be > 0, got {floor_tokens}")
        if capacity_tokens < 0:
            raise ValueError(f"capacity_tokens: must be >= 0, got {capacity_tokens}")
        self.capacity_tokens = max(capacity_tokens, floor_tokens)
        self._lock = threading.Lock()
        self._in_flight = 0
        self._jobs = 0
        self._peak = 0
        self._refused = 0

    def try_acquire(self, num_tokens: int) -> bool:
        """Reserve `num_tokens` if they fit (or nothing is in flight); whether it did."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens: must be >= 0, got {num_tokens}")
        with self._lock:
            if self._jobs and self._in_flight + num_tokens > self.capacity_tokens:
                self._refused += 1
                return False
            self._in_flight += num_tokens
            self._jobs += 1
            self._peak = max(self._peak, self._in_flight)
            return True

    def release(self, num_tokens: int) -> None:
        """Return one job's reservation; RuntimeError if more is released than was acquired."""
        with self._lock:
            if self._jobs == 0 or num_tokens > self._in_flight:
                raise RuntimeError(f"token budget released {num_tokens} with {self._in_flight} in flight")
            self._in_flight -= num_tokens
            self._jobs -= 1

    def state(self) -> BudgetState:
        with self._lock:
            return BudgetState(self.capacity_tokens, self._in_flight, self._peak, self._jobs, self._refused)
