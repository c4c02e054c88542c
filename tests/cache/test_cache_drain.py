"""The cache's flush of pending backups at SIGTERM: the front door's Draining deadline bounds it
when it belongs to this stop, and a deadline left by an earlier stop of the front door alone (a
front door restarted under supervisord, the cache up all along) bounds nothing."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from himamba.bench.servers import unique_endpoints
from himamba.common.config import load
from himamba.common.messages import Draining
from himamba.services.cache.service import CacheService


class _SlowBackups:
    """StorageIO's counters for `pending` backups that complete one per look (no real I/O)."""

    def __init__(self, pending: int) -> None:
        self.pending = pending
        self.done = 0

    def pending_backups(self) -> int:
        if self.pending:
            self.pending -= 1
            self.done += 1
        return self.pending

    def stats(self) -> SimpleNamespace:
        return SimpleNamespace(backup_outcomes={"done": self.done}, num_backup_pages=self.done)


def _flush_after(draining_deadline: float) -> _SlowBackups:
    cfg = load(overrides={"endpoints": unique_endpoints("himamba-drain"), "http": {"shutdown_timeout_s": 30.0}})
    service = CacheService(cfg)
    io = _SlowBackups(pending=5)
    service._io = io  # type: ignore[assignment]
    service.ctrl = SimpleNamespace()  # type: ignore[assignment]  # started: Draining is read by `handle`

    async def stop() -> None:
        await service.handle(Draining(deadline=draining_deadline), [])
        await service.drain(service.drain_timeout_s)

    try:
        asyncio.run(stop())
    finally:
        service.ctx.destroy(linger=0)
    return io


def test_a_deadline_already_spent_by_this_stop_leaves_no_flush():
    io = _flush_after(time.time())  # the front door's drain used the whole of it, just now
    assert io.pending > 0


def test_a_deadline_left_by_an_earlier_front_door_stop_bounds_nothing():
    io = _flush_after(time.time() - 3600)  # the front door alone stopped an hour ago, then came back
    assert io.pending == 0, "the cache's own stop flushed nothing: an old deadline cut it off"
