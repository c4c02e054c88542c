"""Fault injection: a backend wrapper that fails a fraction of calls, for tests and fault drills.

Each call fails with probability `fail_rate` (seeded, so a run is reproducible for a given call
order): half of the failures (`raise_share`) raise StorageError, as an unreachable store would;
the others answer like a store that lost or refused values: `exists` reports a shorter prefix,
`get_pages` stops early after scribbling over the destinations it did not fill (callers must use
only the leading pages it reports), `set_*` refuses, `get_state` misses. `slow_s` delays every call.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence

from himamba.services.cache.storage.base import Buffer, StorageBackend, StorageError, StorageStats

__all__ = ["FlakyBackend"]


class FlakyBackend(StorageBackend):
    """Wraps `inner`; see the module docstring. `num_injected` counts the failures it caused."""

    name = "flaky"

    def __init__(
        self, inner: StorageBackend, fail_rate: float, seed: int, slow_s: float = 0.0, *, raise_share: float = 0.5
    ) -> None:
        if not 0.0 <= fail_rate <= 1.0:
            raise ValueError(f"fail_rate: must be in [0, 1], got {fail_rate}")
        if not 0.0 <= raise_share <= 1.0:
            raise ValueError(f"raise_share: must be in [0, 1], got {raise_share}")
        if slow_s < 0:
            raise ValueError(f"slow_s: must be >= 0, got {slow_s}")
        super().__init__(inner.fingerprint)
        self.inner = inner
        self.fail_rate = fail_rate
        self.raise_share = raise_share
        self.slow_s = slow_s
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.num_injected = 0

    def _fault(self, op: str) -> bool:
        """Whether this call fails quietly; raises for a loud failure."""
        if self.slow_s:
            time.sleep(self.slow_s)
        with self._lock:
            if self._rng.random() >= self.fail_rate:
                return False
            self.num_injected += 1
            loud = self._rng.random() < self.raise_share
        if loud:
            raise StorageError(f"injected failure in {op}")
        return True

    def _cut(self, n: int) -> int:
        with self._lock:
            return self._rng.randrange(n) if n else 0

    def exists(self, keys: Sequence[bytes]) -> int:
        n = self.inner.exists(keys)
        return self._cut(n) if self._fault("exists") else n

    def exists_states(self, keys: Sequence[bytes]) -> list[bool]:
        found = self.inner.exists_states(keys)
        return [False] * len(found) if self._fault("exists_states") else found

    def get_pages(self, keys: Sequence[bytes], dest: Sequence[Buffer]) -> int:
        if not self._fault("get_pages"):
            return self.inner.get_pages(keys, dest)
        n = self.inner.get_pages(keys, dest)
        cut = self._cut(n)
        for buf in dest[cut:]:
            view = memoryview(buf).cast("B")
            view[:] = b"\xa5" * view.nbytes  # what a half-finished read leaves behind
        return cut

    def set_pages(self, keys: Sequence[bytes], blobs: Sequence[Buffer], token_count: int = 0) -> list[bool]:
        if self._fault("set_pages"):
            return [False] * len(keys)
        return self.inner.set_pages(keys, blobs, token_count)

    def get_state(self, key: bytes, dest: Buffer) -> bool:
        return False if self._fault("get_state") else self.inner.get_state(key, dest)

    def set_state(self, key: bytes, blob: Buffer) -> bool:
        return False if self._fault("set_state") else self.inner.set_state(key, blob)

    def close(self) -> None:
        self.inner.close()

    def stats(self) -> StorageStats:
        return self.inner.stats()
