"""After a drain, a server's pools must hold nothing but free and cached entries."""

from __future__ import annotations

import time

from himamba.bench.servers import ServerProcess
from himamba.common.messages import CacheStats


def wait_drained(server: ServerProcess, timeout_s: float = 30.0) -> CacheStats:
    """Poll the cache controller until no request runs; return those stats (invariants checked)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = server.cache_stats(check_invariants=True)
        if stats.running_requests == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def assert_nothing_leaked(stats: CacheStats) -> None:
    """No running request, invariants clean, every device page and state slot free or cached."""
    assert stats.running_requests == 0, f"{stats.running_requests} request(s) still hold pool entries: {stats}"
    assert stats.invariants_ok, stats.invariants_error
    assert stats.free_pages + stats.cached_pages == stats.total_pages, f"device KV pages leaked: {stats}"
    assert stats.free_slots + stats.cached_slots == stats.total_slots, f"device state slots leaked: {stats}"
