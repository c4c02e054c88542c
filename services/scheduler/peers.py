"""The scheduler's readiness and restart protocol with the worker and the cache controller.

Scheduling runs only while the scheduler knows the worker (its WorkerInfo) and has been greeted
back by the cache controller it uses. A restarted worker comes back with empty pools (the
controller resets too, `CacheReset(worker_restarted)`); a restarted controller announces itself
(`CacheReset(cache_started)`) and must be greeted (`Hello`) before use; either way every running
request is requeued with its output kept. The details of the barrier: common/messages.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

from himamba.common.config import Config
from himamba.common.messages import CacheReset, Hello, WorkerInfo
from himamba.common.transport import Outbox
from himamba.services.scheduler import mamba_track
from himamba.services.scheduler.validation import validate_against_worker


class Peers:
    """Whether the worker and the cache controller are ready for this scheduler."""

    def __init__(
        self,
        cfg: Config,
        cache: Outbox,
        strategy: mamba_track.Strategy,
        log: logging.Logger,
        *,
        on_lost: Callable[[str], None],
        on_fatal: Callable[[str], None],
    ) -> None:
        self.cfg = cfg
        self.cache = cache
        self.strategy = strategy
        self.log = log
        self.on_lost = on_lost  # requeue running requests (what the peers held is gone)
        self.on_fatal = on_fatal
        self.info: WorkerInfo | None = None
        self.ready = asyncio.Event()
        self.cache_pid = 0  # the cache controller that answered our Hello (0: none yet)
        self._restarts = 0  # WorkerInfo messages after the first (the worker came back)
        self._resets = 0  # CacheReset confirmations from the cache controller

    def on_worker_info(self, info: WorkerInfo) -> None:
        if self.info is not None and info.pid and info.pid == self.info.pid:
            return  # a repeat (the answer to our Hello)
        if self.info is not None:
            self._restarts += 1
            self.log.warning("worker restarted: requeueing running requests")
            self.on_lost("worker_restarted")
            self.info = info
            self._update()  # scheduling resumes once the cache controller has reset too
            return
        problem = validate_against_worker(self.cfg, info, self.strategy)
        if problem:
            self.on_fatal(f"configuration does not fit the model: {problem}")
            return
        self.info = info
        self._update()
        sc = self.cfg.scheduler
        self.log.info(
            "worker ready: vocab %d, %d pages, %d state slots; strategy %s, track interval %d, overlap %s",
            info.vocab_size,
            info.num_pages,
            info.num_state_slots,
            self.strategy,
            sc.mamba_track_interval,
            not sc.disable_overlap,
        )

    async def on_cache_reset(self, msg: CacheReset) -> None:
        match msg:
            case CacheReset(reason="worker_restarted"):
                self._resets += 1
                self.on_lost("cache_reset")
                self._update()
            case CacheReset(reason="cache_started", cache_pid=pid) if pid != self.cache_pid:
                await self._on_cache_started(pid)
            case CacheReset(reason="scheduler_started", scheduler_pid=mine, cache_pid=pid) if mine == os.getpid():
                if pid != self.cache_pid:
                    self.cache_pid = pid
                    self.log.info("cache controller ready (pid %d)", pid)
                    self._update()
            case _:
                pass  # a repeat, or the answer to another scheduler's Hello

    async def _on_cache_started(self, pid: int) -> None:
        """A new cache controller: what we held in an earlier one is gone. Requeue what ran, and
        greet it; scheduling resumes when it answers."""
        if self.cache_pid:
            self.log.warning("cache controller restarted (pid %d): requeueing running requests", pid)
        self.on_lost("cache_started")
        self.cache_pid = 0
        self._update()
        await self.cache.send(Hello(service="scheduler", pid=os.getpid()))

    def _update(self) -> None:
        if self.info is not None and self._resets >= self._restarts and self.cache_pid:
            self.ready.set()
        else:
            self.ready.clear()
