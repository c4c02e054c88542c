"""CacheService: the cache-controller process. Owns the CacheController and answers by message."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any, Literal, NamedTuple

import msgspec

from himamba.common.config import Config
from himamba.common.host_pool import HostPools, open_host_pools
from himamba.common.messages import (
    Admit,
    Admitted,
    CacheFlushed,
    CacheReset,
    CacheStep,
    CacheStepDone,
    Draining,
    FlushCache,
    GetCacheStats,
    Hello,
    PrefetchDone,
    Ready,
    Shutdown,
    Stopped,
    ToCache,
    TransfersDone,
    WorkerInfo,
)
from himamba.common.metrics import (
    CACHE_BACKUP_BYTES,
    CACHE_BACKUP_OPS,
    CACHE_EVICTED_BYTES,
    CACHE_HIT_TOKENS,
    CACHE_KV_HIT_TOKENS,
    CACHE_MAMBA_STATE_HITS,
    CACHE_PREFETCH_BYTES,
    CACHE_PREFETCH_OPS,
    CACHE_PREFETCH_TRUNCATIONS,
    CACHE_QUERY_TOKENS,
    CACHE_STORAGE_ERRORS,
    CACHE_STORAGE_EVENTS,
    CACHE_STORAGE_UP,
    CACHE_TRANSFERS_IN_FLIGHT,
    POOL_CAPACITY_BYTES,
    POOL_EVICTABLE_BYTES,
    POOL_PROTECTED_BYTES,
    POOL_USED_BYTES,
)
from himamba.common.metrics_report import MetricsReporter, ServiceMetrics
from himamba.common.transport import Outbox
from himamba.services.actor import Actor
from himamba.services.cache.controller import CacheController, HostCopyCounts
from himamba.services.cache.flush import flush_refusal, flushed
from himamba.services.cache.keys import model_fingerprint
from himamba.services.cache.storage.factory import open_configured_backend
from himamba.services.cache.storage.flaky import FlakyBackend
from himamba.services.cache.storage.io_workers import IOStats, ShutdownResult, StorageIO

# The backend's own counters (StorageStats fields) behind each storage event label.
_BACKEND_EVENTS = {
    "unreachable": "num_errors",
    "reconnect": "num_reconnects",
    "refused_write": "num_refused_writes",
    "corrupt": "num_corrupt",
}


def storage_pool_bytes(backend: Any) -> dict[str, tuple[int, int]]:
    """(capacity, used) bytes per kind of a storage backend's stats. KV pages and states share one
    cap, so each kind can hold what it holds plus the shared free part: the capacity of a kind is
    that sum (0 for both when the store has no cap), and a kind's use over its capacity is honest,
    where the cap reported under one kind made the other's 0."""
    used = {"kv": max(0, backend.used_bytes - backend.used_state_bytes), "mamba": backend.used_state_bytes}
    cap = backend.capacity_bytes
    free = max(0, cap - backend.used_bytes)
    return {kind: (nbytes + free if cap else 0, nbytes) for kind, nbytes in used.items()}


# What a flush at shutdown leaves before the stop's deadline: cancelling the rest and joining the
# running backups' last write.
FLUSH_MARGIN_S = 0.5
# A Draining deadline that passed longer ago than this when the cache's own stop begins was a stop of
# the front door alone (restarted, the cache up all along): it bounds nothing now. The launcher
# stops the back end as soon as the front door exits, well within this of the deadline.
STALE_DRAINING_S = 60.0


class StorageClosed(NamedTuple):
    """How the storage tier closed: its I/O pool's shutdown and final counters."""

    shutdown: ShutdownResult
    stats: IOStats
    running_backups: int  # still running when it closed (abandoned at exit: not stored)


class CacheService(Actor[ToCache]):
    name = "cache"

    def __init__(self, cfg: Config):
        super().__init__(cfg, cfg.endpoints.cache_ipc, ToCache)  # type: ignore[arg-type]
        self.scheduler = Outbox(self.ctx, cfg.endpoints.scheduler_ipc)
        self.worker = Outbox(self.ctx, cfg.endpoints.worker_ipc)
        self.ctrl: CacheController | None = None
        self._worker_pid = 0  # the worker whose pools the controller describes
        self._scheduler_pid = 0  # the scheduler this controller serves (greeted with Hello)
        self._greetings: set[int] = set()  # schedulers waiting for the worker barrier
        self._early: list[tuple[Any, list[Any]]] = []
        self.tokenizer = Outbox(self.ctx, cfg.endpoints.tokenizer_ipc)
        self.reporter = MetricsReporter("cache", self.tokenizer, cfg.metrics.report_interval_s)
        self.m = self.reporter.metrics
        self.reporter.on_collect(self._collect_metrics)
        self._page_bytes = 0
        self._slot_bytes = 0
        self._evicted_seen = (0, 0)
        self._host_copies_seen = HostCopyCounts()
        self._host_pools: HostPools | None = None
        self._io: StorageIO | None = None
        self._storage_seen: dict[str, int] = {}
        self._cache_steps = 0
        self._storage_work = asyncio.Event()  # set when a step or an ack may have started storage work
        self._storage_announced = False
        # SIGTERM: pending backups are flushed until the stop's deadline (the front door's Draining
        # says it: what its drain left of --shutdown-timeout; alone, the whole of it).
        self.drain_timeout_s = cfg.http.shutdown_timeout_s
        self._stop_by: float | None = None
        self._flush_from: tuple[float, int, int] | None = None  # (monotonic start, backups done, pages)

    async def start(self) -> str:
        # The pools' sizes come from the worker, which knows the model; wait for it.
        assert self.inbox is not None
        # A worker that is already up sent its WorkerInfo to an earlier cache: ask again.
        await self.worker.send(Hello(service=self.name, pid=os.getpid()))
        self.log.info("waiting for the worker's pool sizes")
        while self.ctrl is None:
            msg, frames = await self.inbox.recv()
            if isinstance(msg, WorkerInfo):
                self.on_worker_info(msg)
            elif isinstance(msg, Shutdown):
                raise RuntimeError("shut down before the worker was ready")
            else:
                self._early.append((msg, frames))
        c = self.ctrl
        return (
            f"{c.device_kv.capacity} device pages, {c.device_state.capacity} device state slots, "
            f"radix cache {'off' if c.tree is None else 'on'}"
        )

    def _collect_metrics(self, m: ServiceMetrics) -> None:
        if self.ctrl is None:
            return
        st = self.ctrl.stats()
        t = self.ctrl.tree.usage() if self.ctrl.tree is not None else None
        # Evictable: cached in the tree and not locked by a request or pinned by a transfer; the
        # rest of what is used (running requests' own pages, locked prefixes, copies in flight)
        # is protected.
        pools = {
            ("device", "kv"): (st.total_pages, st.free_pages, t.device_pages_evictable if t else 0, self._page_bytes),
            ("device", "mamba"): (st.total_slots, st.free_slots, t.device_states_evictable if t else 0, self._slot_bytes),
            ("host", "kv"): (st.total_host_pages, st.free_host_pages, t.host_pages_evictable if t else 0, self._page_bytes),
            ("host", "mamba"): (
                st.total_host_slots, st.free_host_slots, t.host_states_evictable if t else 0, self._slot_bytes,
            ),
        }  # fmt: skip
        for (tier, kind), (total, free, evictable, unit) in pools.items():
            used = total - free
            m[POOL_CAPACITY_BYTES].labels(tier=tier, kind=kind).set(total * unit)
            m[POOL_USED_BYTES].labels(tier=tier, kind=kind).set(used * unit)
            m[POOL_EVICTABLE_BYTES].labels(tier=tier, kind=kind).set(min(evictable, used) * unit)
            m[POOL_PROTECTED_BYTES].labels(tier=tier, kind=kind).set(max(0, used - evictable) * unit)
        pages, states = self.ctrl.evicted_pages, self.ctrl.evicted_states
        m[CACHE_EVICTED_BYTES].labels(tier="device", kind="kv").inc((pages - self._evicted_seen[0]) * self._page_bytes)
        m[CACHE_EVICTED_BYTES].labels(tier="device", kind="mamba").inc((states - self._evicted_seen[1]) * self._slot_bytes)
        self._evicted_seen = (pages, states)
        m[CACHE_TRANSFERS_IN_FLIGHT].labels(tier="host").set(len(self.ctrl.pending))
        self._report_host_copies()
        tier = self.ctrl.storage
        if tier is None or self._io is None:
            m[CACHE_STORAGE_UP].set(0)
            return
        c = tier.counters
        backend = self._io.backend.stats()
        m[CACHE_STORAGE_UP].set(1 if backend.reachable else 0)
        self._storage_pool_gauges(backend)
        now = {
            "backup_kv_bytes": c.backup_bytes - c.backup_state_bytes,
            "backup_state_bytes": c.backup_state_bytes,
            "backup_ops": c.backup_ops,
            "prefetch_kv_bytes": c.prefetch_bytes - c.prefetch_state_bytes,
            "prefetch_state_bytes": c.prefetch_state_bytes,
            "prefetch_ops": c.prefetch_ops,
            "truncations": c.truncations,
            **{f"err_{op}": n for op, n in c.errors.items()},
            **{f"event_{event}": getattr(backend, field) for event, field in _BACKEND_EVENTS.items()},
        }

        def delta(name: str) -> int:
            d = now.get(name, 0) - self._storage_seen.get(name, 0)
            return max(d, 0)

        m[CACHE_BACKUP_BYTES].labels(tier="storage", kind="kv").inc(delta("backup_kv_bytes"))
        m[CACHE_BACKUP_BYTES].labels(tier="storage", kind="mamba").inc(delta("backup_state_bytes"))
        m[CACHE_BACKUP_OPS].labels(tier="storage").inc(delta("backup_ops"))
        m[CACHE_PREFETCH_BYTES].labels(tier="storage", kind="kv").inc(delta("prefetch_kv_bytes"))
        m[CACHE_PREFETCH_BYTES].labels(tier="storage", kind="mamba").inc(delta("prefetch_state_bytes"))
        m[CACHE_PREFETCH_OPS].labels(tier="storage").inc(delta("prefetch_ops"))
        m[CACHE_PREFETCH_TRUNCATIONS].inc(delta("truncations"))
        for op in c.errors:
            m[CACHE_STORAGE_ERRORS].labels(op=op).inc(delta(f"err_{op}"))
        for event in _BACKEND_EVENTS:
            m[CACHE_STORAGE_EVENTS].labels(event=event).inc(delta(f"event_{event}"))
        io = self._io.stats()
        m[CACHE_TRANSFERS_IN_FLIGHT].labels(tier="storage").set(io.num_queued + io.num_running)
        self._storage_seen = now

    def _storage_pool_gauges(self, backend: Any) -> None:
        """The storage tier as a pool, per kind (see `storage_pool_bytes`); everything stored is
        evictable (nothing pins a stored value)."""
        m = self.m
        for kind, (capacity, used) in storage_pool_bytes(backend).items():
            m[POOL_CAPACITY_BYTES].labels(tier="storage", kind=kind).set(capacity)
            m[POOL_USED_BYTES].labels(tier="storage", kind=kind).set(used)
            m[POOL_EVICTABLE_BYTES].labels(tier="storage", kind=kind).set(used)
            m[POOL_PROTECTED_BYTES].labels(tier="storage", kind=kind).set(0)

    def _report_host_copies(self) -> None:
        m, now, seen = self.m, self.ctrl.host_copies, self._host_copies_seen  # type: ignore[union-attr]
        m[CACHE_BACKUP_OPS].labels(tier="host").inc(now.backup_ops - seen.backup_ops)
        m[CACHE_BACKUP_BYTES].labels(tier="host", kind="kv").inc((now.backup_pages - seen.backup_pages) * self._page_bytes)
        m[CACHE_BACKUP_BYTES].labels(tier="host", kind="mamba").inc(
            (now.backup_states - seen.backup_states) * self._slot_bytes
        )
        m[CACHE_PREFETCH_OPS].labels(tier="host").inc(now.load_ops - seen.load_ops)
        m[CACHE_PREFETCH_BYTES].labels(tier="host", kind="kv").inc((now.load_pages - seen.load_pages) * self._page_bytes)
        m[CACHE_PREFETCH_BYTES].labels(tier="host", kind="mamba").inc((now.load_states - seen.load_states) * self._slot_bytes)
        self._host_copies_seen = dataclasses.replace(now)

    def _count_admission(self, op: Admit, res: Admitted) -> None:
        if not op.use_cache:
            return
        self.m[CACHE_QUERY_TOKENS].inc(len(op.tokens))
        for tier in ("device", "host", "storage"):
            self.m[CACHE_HIT_TOKENS].labels(tier=tier).inc(getattr(res.cached, tier))
        self.m[CACHE_KV_HIT_TOKENS].labels(tier="device").inc(res.cached_len + res.branch_len)
        if res.state_src is not None and res.cached_len > 0:
            self.m[CACHE_MAMBA_STATE_HITS].labels(tier="device").inc()

    async def background(self) -> None:
        # Before anything else reaches the scheduler: a scheduler that used an earlier cache
        # controller must forget what it held there, and greet this one.
        await self.scheduler.send(self._reset_message("cache_started"))
        await self.tokenizer.send(Ready(service=self.name, pid=os.getpid()))
        self.spawn(self.reporter.run(), "metrics")
        self.spawn(self._poll_storage(), "storage-poll")
        early, self._early = self._early, []
        for msg, frames in early:
            await self.handle(msg, frames)

    async def drain(self, timeout_s: float) -> None:
        """Flush the backups queued or running until the stop's deadline; `stop` cancels the rest
        (not stored: a value is written whole or not at all)."""
        io = self._io
        if io is None:
            return
        done, pages = self._backups_done(io.stats())
        self._flush_from = (time.monotonic(), done, pages)
        left = timeout_s
        if self._stop_by is not None and time.time() - self._stop_by < STALE_DRAINING_S:
            left = min(timeout_s, self._stop_by - time.time())
        deadline = time.monotonic() + max(0.0, left - FLUSH_MARGIN_S)
        while io.pending_backups() and time.monotonic() < deadline:
            self._storage_work.set()  # the poll task finalises what completes
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        flush = self._flush_from
        closed = self._close_storage(drain=flush is None)  # a flush had its time: cancel what is left
        if flush is None or closed is None:
            return
        started, done0, pages0 = flush
        done, pages = self._backups_done(closed.stats)
        not_flushed = closed.shutdown.num_cancelled_backups + closed.running_backups
        summary = (
            f"flushed {done - done0} backup(s) ({pages - pages0} pages) in {time.monotonic() - started:.1f}s, "
            f"{not_flushed} not flushed (not stored)"
        )
        self.log.info("shutdown: %s", summary)
        try:
            await self.control.send(Stopped(service=self.name, pid=os.getpid(), summary=summary))
        except Exception as e:  # noqa: BLE001 - the launcher may be gone: the log line stands
            self.log.debug("could not tell the launcher how the stop went: %r", e)

    @staticmethod
    def _backups_done(stats: IOStats) -> tuple[int, int]:
        """Backups that ended DONE or PARTIAL so far, and the pages they wrote."""
        outcomes = stats.backup_outcomes
        return outcomes.get("done", 0) + outcomes.get("partial", 0), stats.num_backup_pages

    async def _poll_storage(self) -> None:
        # Storage jobs complete on worker threads; finalise them here, whatever the scheduler does,
        # and tell the scheduler when a request it holds back for its prefetch may go. Sleeps on an
        # event while the storage tier has nothing in flight (an idle server polls nothing).
        while True:
            ctrl = self.ctrl
            busy = ctrl is not None and ctrl.storage is not None and ctrl.storage.busy
            if not busy and not (ctrl is not None and ctrl.awaiting_prefetch):
                self._storage_work.clear()
                await self._storage_work.wait()
                continue
            await asyncio.sleep(0.005)
            if ctrl is None or ctrl is not self.ctrl:
                continue
            ctrl.poll_storage()
            ready = ctrl.take_prefetch_ready()
            if ready:
                await self.scheduler.send(PrefetchDone(rids=ready))

    def _close_storage(self, drain: bool = False) -> StorageClosed | None:
        """Close the storage tier (None: it was not open); queued backups run with `drain`, else
        they are cancelled."""
        closed = None
        if self.ctrl is not None and self.ctrl.storage is not None and self._io is not None:
            shutdown = self.ctrl.storage.close(drain=drain)
            closed = StorageClosed(shutdown, self._io.stats(), self._io.pending_backups())
        if self._io is not None:
            self._io.backend.close()
            self._io = None
        if self._host_pools is not None:
            self._host_pools.close()
            self._host_pools = None
        return closed

    def _open_storage(self, info: WorkerInfo) -> None:
        """The storage tier over the worker's shared host pools; failures leave it off (logged)."""
        cache = self.cfg.cache
        layout = info.host_layout
        if cache.hicache_storage_backend == "none" or self.ctrl is None or not layout.num_pages:
            return
        try:
            fp = model_fingerprint(
                Path(self.cfg.model.model), self.cfg.model.dtype, cache.page_size, layout.tp_size
            )
            backend = open_configured_backend(cache, fp)
            assert backend is not None
            debug = self.cfg.debug
            if debug.storage_fail_rate or debug.storage_slow_s:
                backend = FlakyBackend(backend, debug.storage_fail_rate, seed=0, slow_s=debug.storage_slow_s)
            self._host_pools = open_host_pools(layout, create=False, rank=None)
            self._io = StorageIO(
                backend,
                self._host_pools.kv_bytes,
                self._host_pools.state_bytes,
                page_size=cache.page_size,
                prefetch_budget_tokens=max(layout.num_pages * cache.page_size, cache.page_size),
                stall_prefetch_at=self.cfg.debug.storage_prefetch_stall_pages,
            )
        except (ValueError, OSError, RuntimeError) as e:
            self.log.warning("storage tier off: %s: %s", type(e).__name__, e)
            return
        self.ctrl.attach_storage(self._io, fp)
        # Reopened after every reset of the pools: say so once, not at each reopening.
        level = logging.DEBUG if self._storage_announced else logging.INFO
        self.log.log(level, "storage tier on: %s backend", cache.hicache_storage_backend)
        self._storage_announced = True

    def _reset_message(
        self, reason: Literal["worker_restarted", "cache_started", "scheduler_started"], scheduler_pid: int = 0
    ) -> CacheReset:
        assert self.ctrl is not None
        return CacheReset(
            num_pages=self.ctrl.device_kv.capacity,
            num_state_slots=self.ctrl.device_state.capacity,
            reason=reason,
            cache_pid=os.getpid(),
            scheduler_pid=scheduler_pid,
        )

    async def _on_worker_info(self, info: WorkerInfo) -> None:
        if info.pid and info.pid == self._worker_pid:
            # The worker's answer to our Hello, in its inbox order: every batch and copy an earlier
            # scheduler sent it has run, so the pools can be handed out afresh.
            if self._greetings:
                if self._scheduler_pid:  # a previous scheduler held pages and slots: that is news
                    self.log.warning("a new scheduler: forgetting the cache and what the previous one held")
                else:  # the first scheduler of this controller: nothing to forget
                    self.log.info("serving scheduler pid %s", ", ".join(map(str, sorted(self._greetings))))
                self._close_storage()
                self.on_worker_info(info)
                await self._answer_greetings()
            return
        # A restarted worker has empty pools: every page and state the tree knew is gone.
        self.log.warning("worker restarted: forgetting the cache and every request's memory")
        self._close_storage()
        self.on_worker_info(info)
        await self.scheduler.send(self._reset_message("worker_restarted"))
        await self._answer_greetings()

    async def _answer_greetings(self) -> None:
        for pid in sorted(self._greetings):
            self._scheduler_pid = pid
            await self.scheduler.send(self._reset_message("scheduler_started", pid))
        self._greetings.clear()

    async def _on_scheduler_hello(self, pid: int) -> None:
        if pid == self._scheduler_pid:
            # A repeat from the scheduler this controller already serves: nothing to forget.
            await self.scheduler.send(self._reset_message("scheduler_started", pid))
            return
        if not self._greetings:
            await self.worker.send(Hello(service=self.name, pid=os.getpid()))  # the barrier
        self._greetings.add(pid)

    def on_worker_info(self, info: WorkerInfo) -> None:
        self._worker_pid = info.pid
        self._page_bytes = info.kv_bytes_per_token * self.cfg.cache.page_size
        self._slot_bytes = info.state_bytes_per_slot
        self._evicted_seen = (0, 0)
        self._host_copies_seen = HostCopyCounts()
        self.ctrl = CacheController(
            self.cfg.cache,
            num_pages=info.num_pages,
            num_slots=info.num_state_slots,
            num_host_pages=info.num_host_pages,
            num_host_slots=info.num_host_state_slots,
        )
        self._open_storage(info)

    async def handle(self, msg: ToCache, frames: list[Any]) -> None:
        assert self.ctrl is not None
        match msg:
            case CacheStep(cache_pid=cache_pid) if cache_pid and cache_pid != os.getpid():
                self.log.info("ignoring a cache step meant for an earlier cache controller (pid %d)", cache_pid)
            case CacheStep(step_id=step_id, ops=ops):
                self._cache_steps += 1
                results = self.ctrl.apply_step(ops)
                for op, res in zip(ops, results, strict=True):
                    if isinstance(op, Admit) and isinstance(res, Admitted) and res.ok:
                        self._count_admission(op, res)
                transfers = self.ctrl.take_transfers()
                await self.scheduler.send(CacheStepDone(step_id=step_id, results=results, transfers=transfers))
                self._storage_work.set()
            case TransfersDone(op_ids=op_ids, failed=failed):
                if failed:
                    self.log.warning("the worker failed %d copy orders: rolling them back", len(failed))
                self.ctrl.transfers_done(op_ids, failed)
                self._storage_work.set()  # acknowledged host copies start storage backups
            case GetCacheStats(reply_to=reply_to, check_invariants=check):
                stats = msgspec.structs.replace(self.ctrl.stats(), cache_steps=self._cache_steps)
                if check:
                    try:
                        self.ctrl.check_invariants()
                    except AssertionError as e:
                        stats = type(stats)(**{**_fields(stats), "invariants_ok": False, "invariants_error": str(e)})
                out = Outbox(self.ctx, reply_to)
                await out.send(stats)
                out.close()
            case FlushCache(flush_id=flush_id, reply_to=reply_to):
                out = Outbox(self.ctx, reply_to)
                await out.send(self._flush(flush_id))
                out.close()
            case WorkerInfo():
                await self._on_worker_info(msg)
            case Hello(service="scheduler", pid=pid):
                await self._on_scheduler_hello(pid)
            case Hello(service=service):
                self.log.warning("hello from %r: nothing to do", service)
            case Draining(deadline=deadline):
                self._stop_by = deadline
            case Shutdown():
                pass

    def _flush(self, flush_id: int) -> CacheFlushed:
        """sglang's /flush_cache: an idle controller becomes an empty one (see flush.py)."""
        assert self.ctrl is not None
        refusal = flush_refusal(self.ctrl)
        if refusal is not None:
            return CacheFlushed(flush_id=flush_id, ok=False, error=refusal.reason, busy=refusal.busy)
        self.ctrl, freed = flushed(self.ctrl)
        self.log.info(
            "cache flushed: %d device pages, %d device states, %d host pages, %d host states freed",
            *freed,
        )
        return CacheFlushed(flush_id=flush_id, ok=True, **freed._asdict())



def _fields(s: Any) -> dict[str, Any]:
    return {f: getattr(s, f) for f in s.__struct_fields__}
