"""Failing fast while a remote store is away, and finding out when it is back.

A remote store that goes away makes every call wait for a connect or RPC timeout (seconds each).
`ReconnectGate` turns that into one slow call per outage: the first failure opens the gate, and
while it is open calls are refused at once (the backend answers a miss / refused write and counts
an error). After a backoff (doubling from `base_s` up to `max_s`, with jitter so that many servers
do not probe in step) exactly one call is let through as a probe; its success closes the gate, its
failure reopens it for the next, longer, backoff. Nothing is restarted: the client library
reconnects on the probe's call.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from himamba.services.cache.storage.base import StorageCounters

__all__ = ["GateState", "ReconnectGate", "StoreLink"]

_log = logging.getLogger("himamba.cache.storage")


class GateState(NamedTuple):
    """A snapshot for logs and tests."""

    is_open: bool  # the store is considered away: calls fail fast
    consecutive_failures: int
    retry_in_s: float  # until the next probe may run (0 when closed or due)


class ReconnectGate:
    """Thread-safe fail-fast gate with exponential backoff; see the module docstring."""

    def __init__(
        self,
        base_s: float = 0.5,
        max_s: float = 30.0,
        *,
        jitter: float = 0.2,
        seed: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if base_s <= 0:
            raise ValueError(f"base_s: must be > 0, got {base_s}")
        if max_s < base_s:
            raise ValueError(f"max_s: must be >= base_s ({base_s}), got {max_s}")
        if not 0.0 <= jitter < 1.0:
            raise ValueError(f"jitter: must be in [0, 1), got {jitter}")
        self.base_s = base_s
        self.max_s = max_s
        self.jitter = jitter
        self._clock = clock
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._open = False
        self._failures = 0
        self._retry_at = 0.0
        self._probing = False

    def admit(self) -> bool:
        """Whether a call may go to the store now. While open, only one caller (the probe) is
        admitted once the backoff has passed; it must report `succeeded()` or `failed()`."""
        with self._lock:
            if not self._open:
                return True
            if self._probing or self._clock() < self._retry_at:
                return False
            self._probing = True
            return True

    def succeeded(self) -> bool:
        """Report a call that reached the store; True when this closed an open gate (the store
        came back)."""
        with self._lock:
            reopened = self._open
            self._open = False
            self._probing = False
            self._failures = 0
            return reopened

    def failed(self) -> bool:
        """Report a call that could not reach the store; True when this opened a closed gate (the
        store just went away)."""
        with self._lock:
            opened = not self._open
            self._open = True
            self._probing = False
            self._failures += 1
            delay = min(self.max_s, self.base_s * 2 ** min(self._failures - 1, 32))
            delay *= 1.0 + self.jitter * (2.0 * self._rng.random() - 1.0)
            self._retry_at = self._clock() + delay
            return opened

    def abandon(self) -> None:
        """Report a call that ended without telling whether the store is reachable (an unexpected
        exception): a probe slot it held is freed, nothing else changes."""
        with self._lock:
            self._probing = False

    def state(self) -> GateState:
        with self._lock:
            wait = max(0.0, self._retry_at - self._clock()) if self._open else 0.0
            return GateState(self._open, self._failures, wait)


class StoreLink:
    """One remote backend's view of its store: the gate, plus the counters (`num_errors`,
    `num_reconnects`) and the one warning per outage that go with it."""

    def __init__(self, what: str, counters: StorageCounters, gate: ReconnectGate) -> None:
        self.what = what  # names the store in logs, e.g. "redis at redis://10.0.0.5:6379/0"
        self.counters = counters
        self.gate = gate

    def reachable(self) -> bool:
        """False while the store is considered away (between a failure and a successful probe)."""
        return not self.gate.state().is_open

    def admit(self) -> bool:
        """Whether to call the store now; a refused call is counted as an error."""
        if self.gate.admit():
            return True
        self.counters.add(num_errors=1)
        return False

    def reached(self) -> None:
        """The call reached the store (whatever it answered)."""
        if self.gate.succeeded():
            self.counters.add(num_reconnects=1)
            _log.warning("storage: %s is reachable again", self.what)

    def lost(self, why: str) -> None:
        """The call could not reach the store: count it, and fail fast for a while."""
        self.counters.add(num_errors=1)
        if self.gate.failed():
            _log.warning(
                "storage: %s is unreachable (%s); storage calls fail fast (misses, skipped writes) "
                "and it is retried with backoff up to %.0f s",
                self.what,
                why,
                self.gate.max_s,
            )

    def abandon(self) -> None:
        """The call ended in an unexpected exception."""
        self.gate.abandon()
