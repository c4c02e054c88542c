"""Storage I/O workers: a small supervised thread pool that runs backups (host -> storage) and
prefetches (storage -> host) for the cache controller.

The controller's event loop submits jobs and gets a `JobHandle` whose `future` (a
concurrent.futures.Future) completes with a `JobResult` from a worker thread; the loop awaits it
with `asyncio.wrap_future(handle.future)`. Every submitted job completes exactly once, whatever
happens: done, partial (a miss or a refused write), revoked, failed (an exception), cancelled
(shutdown) or refused (prefetch budget). Jobs move bytes between the backend and the shared host
pools through their uint8 views: a prefetch reads each file straight into its host page.

Supervision: an exception escaping a job fails that job (its result says how far it got), is
logged and counted, and the worker thread is replaced, so the pool never shrinks silently.

`lookup` runs the storage hit query (`find_hit`) on a thread of its own, so the loop never
blocks on a slow store.

Ownership: the host pages and state slot named by a job belong to the job until its future
completes; the caller keeps them protected (and must not reuse them) until then. Prefetches run
before queued backups: a request may be waiting on them.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple

import msgspec
import numpy as np
import torch

from himamba.services.cache.storage.base import StorageBackend, StorageHit, find_hit
from himamba.services.cache.storage.budget import BudgetState, TokenBudget

__all__ = [
    "BACKUP_BATCH_PAGES",
    "PREFETCH_BATCH_PAGES",
    "IOStats",
    "JobHandle",
    "JobKind",
    "JobOutcome",
    "JobResult",
    "ShutdownResult",
    "StateCopy",
    "StorageIO",
]

_log = logging.getLogger("himamba.cache.storage")
_STALL_MAX_S = 60.0
# Pages per backend call. A prefetch checks for a revoke between calls (a request admitted
# mid-fetch waits at most one call); a backup has no one waiting, so it writes in larger calls,
# which costs fewer syscalls and less per-call work (what keeps the file tier near the disk).
PREFETCH_BATCH_PAGES = 8
BACKUP_BATCH_PAGES = 32


class JobKind(StrEnum):
    BACKUP = "backup"  # host -> storage
    PREFETCH = "prefetch"  # storage -> host


class JobOutcome(StrEnum):
    """How a job ended. In every case `num_pages` leading pages (and the state iff `state_ok`)
    were moved and verified; the rest of the job's host pages hold unspecified bytes."""

    DONE = "done"  # every page, and the state if the job had one
    PARTIAL = "partial"  # stopped at a miss (prefetch) or a refused write (backup)
    REVOKED = "revoked"  # the caller revoked it
    FAILED = "failed"  # an exception (backend error or a crashed worker)
    CANCELLED = "cancelled"  # never ran: the pool shut down
    REFUSED = "refused"  # never ran: over the prefetch token budget


class StateCopy(NamedTuple):
    """A recurrent state travelling with a job: stored under the key of the page where it was
    captured, held in host state slot `host_slot`."""

    page_key: bytes
    host_slot: int


class JobResult(NamedTuple):
    """What one job did, with its timing and volume for metrics."""

    job_id: int
    kind: JobKind
    tag: Any  # the caller's tag, echoed
    outcome: JobOutcome
    num_pages: int
    state_ok: bool
    num_bytes: int  # bytes moved (payloads), including a batch discarded by a revoke
    num_state_bytes: int  # the part of num_bytes that was the recurrent state
    queued_s: float
    run_s: float
    error: str | None
    # Prefetch: the intermediate states (`mid_states`, by page count) read and verified, each
    # only once every page before it was: a partial job can still end at one of them.
    states_read: tuple[int, ...] = ()


class ShutdownResult(NamedTuple):
    num_cancelled: int  # queued jobs completed as CANCELLED
    num_unjoined: int  # worker threads still busy after the timeout (their jobs finish later)
    num_cancelled_backups: int = 0  # of num_cancelled: backups, whose values are then not stored


class IOStats(msgspec.Struct, frozen=True, kw_only=True):
    """Counters of the pool since it started (gauges: queued, running, budget in flight)."""

    num_workers: int
    num_worker_restarts: int
    num_lookups: int
    num_lookup_errors: int
    num_queued: int
    num_running: int
    backup_outcomes: dict[str, int]
    prefetch_outcomes: dict[str, int]
    num_backup_pages: int
    num_backup_bytes: int
    backup_run_s: float
    num_prefetch_pages: int
    num_prefetch_bytes: int
    prefetch_run_s: float
    budget: BudgetState


@dataclass(eq=False)
class _Job:
    id: int
    kind: JobKind
    keys: list[bytes]
    host_pages: list[int]
    state: StateCopy | None
    tag: Any
    num_tokens: int  # reserved from the budget (prefetch only)
    mid_states: list[tuple[int, StateCopy]] = field(default_factory=list)  # (after this many pages, state)
    states_read: list[int] = field(default_factory=list)
    future: Future[JobResult] = field(default_factory=Future)
    lock: threading.Lock = field(default_factory=threading.Lock)
    submitted: float = field(default_factory=time.monotonic)
    started: float | None = None
    revoked: bool = False
    num_pages: int = 0  # frozen by a revoke
    state_ok: bool = False
    num_bytes: int = 0
    num_state_bytes: int = 0
    finished: bool = False


class JobHandle:
    """The caller's side of a submitted job."""

    def __init__(self, job: _Job) -> None:
        self._job = job

    @property
    def id(self) -> int:
        return self._job.id

    @property
    def kind(self) -> JobKind:
        return self._job.kind

    @property
    def future(self) -> Future[JobResult]:
        """Completes with the JobResult (from a worker thread); asyncio: `asyncio.wrap_future`."""
        return self._job.future

    @property
    def num_pages(self) -> int:
        """Leading pages completed so far (final once revoked or done)."""
        with self._job.lock:
            return self._job.num_pages

    def revoke(self) -> int:
        """Ask the job to stop issuing I/O at its next batch boundary; returns the number of
        leading pages completed, which is final: the result reports exactly this many (pages
        landing later are discarded). The job's other pages stay in its use until `future`
        completes. Revoking a finished job changes nothing."""
        job = self._job
        with job.lock:
            if not job.finished:
                job.revoked = True
            return job.num_pages


class StorageIO:
    """Supervised storage I/O threads over one backend and the host pools' uint8 views.

    `kv_bytes` is [num_host_pages, page_bytes] and `state_bytes` [num_host_slots, slot_bytes]
    (HostPools.kv_bytes / state_bytes; either may be None). Prefetches move `batch_pages` pages per
    backend call and check for revocation between calls; backups move `backup_batch_pages` per
    call. `prefetch_budget_tokens` caps prefetch
    tokens in flight, floored at one batch."""

    def __init__(
        self,
        backend: StorageBackend,
        kv_bytes: torch.Tensor | None,
        state_bytes: torch.Tensor | None,
        *,
        page_size: int,
        prefetch_budget_tokens: int,
        num_workers: int = 2,
        batch_pages: int = PREFETCH_BATCH_PAGES,
        backup_batch_pages: int = BACKUP_BATCH_PAGES,
        stall_prefetch_at: int = 0,
    ) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size: must be > 0, got {page_size}")
        if num_workers <= 0:
            raise ValueError(f"num_workers: must be > 0, got {num_workers}")
        if batch_pages <= 0 or backup_batch_pages <= 0:
            raise ValueError(f"batch_pages, backup_batch_pages: must be > 0, got {batch_pages}, {backup_batch_pages}")
        self.backend = backend
        self.page_size = page_size
        self.batch_pages = batch_pages
        self.backup_batch_pages = backup_batch_pages
        self.num_workers = num_workers
        # Test hook (0: off): a prefetch job holds after this many pages until it is revoked, so a
        # test can admit its request mid-fetch deterministically (bounded by `_STALL_MAX_S`).
        self.stall_prefetch_at = stall_prefetch_at
        self._kv = _rows(kv_bytes, "kv_bytes")
        self._state = _rows(state_bytes, "state_bytes")
        self.budget = TokenBudget(prefetch_budget_tokens, floor_tokens=page_size * batch_pages)
        self._ids = itertools.count(1)
        self._cond = threading.Condition()  # guards everything below
        self._prefetches: deque[_Job] = deque()
        self._backups: deque[_Job] = deque()
        self._running: dict[int, _Job] = {}  # worker slot -> job
        self._threads: dict[int, threading.Thread] = {}
        self._closed = False
        self._restarts = 0
        self._lookups = 0
        self._lookup_errors = 0
        self._lookup_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="himamba-storage-lookup")
        self._outcomes = {k: dict.fromkeys(JobOutcome, 0) for k in JobKind}
        self._pages = dict.fromkeys(JobKind, 0)
        self._bytes = dict.fromkeys(JobKind, 0)
        self._run_s = dict.fromkeys(JobKind, 0.0)
        with self._cond:
            for slot in range(num_workers):
                self._spawn(slot)

    # ---- submitting ----------------------------------------------------------------------------

    def submit_backup(
        self, keys: list[bytes], host_pages: list[int], state: StateCopy | None = None, tag: Any = None
    ) -> JobHandle:
        """Write host pages (and a state) to storage under their page keys. The result's
        `num_pages` leading pages are stored; a page counts as stored only then."""
        job = self._make(JobKind.BACKUP, keys, host_pages, state, tag, num_tokens=0)
        self._enqueue(job)
        return JobHandle(job)

    def submit_prefetch(
        self,
        keys: list[bytes],
        host_pages: list[int],
        state: StateCopy | None = None,
        tag: Any = None,
        mid_states: list[tuple[int, StateCopy]] = (),  # type: ignore[assignment]
    ) -> JobHandle:
        """Read pages (then the state, only if every page arrived) from storage into host memory.
        `mid_states` (page count, state), ascending and inside the job, are read as soon as their
        pages are, so a job revoked half-way still ends at a state (hybrid models). Completes at
        once as REFUSED when its tokens do not fit the in-flight budget."""
        job = self._make(JobKind.PREFETCH, keys, host_pages, state, tag, num_tokens=len(keys) * self.page_size)
        for at, st in mid_states:
            if not 0 < at < len(keys) or self._state is None or not 0 <= st.host_slot < len(self._state):
                raise ValueError(f"mid_states: ({at}, slot {st.host_slot}) is outside the job or the state pool")
        job.mid_states = sorted(mid_states)
        if not self.budget.try_acquire(job.num_tokens):
            self._finish(job, JobOutcome.REFUSED, None, release=False)
        else:
            self._enqueue(job)
        return JobHandle(job)

    def lookup(self, keys: list[bytes], *, needs_state: bool) -> Future[StorageHit]:
        """`find_hit` off the caller's thread (an exists query costs a syscall per key, or a network
        round trip). A failing backend is logged and counted and answers StorageHit(0, 0), as does
        a closed pool; a lookup still queued at shutdown is cancelled."""
        with self._cond:
            if not self._closed:
                self._lookups += 1
                return self._lookup_pool.submit(self._lookup, list(keys), needs_state)
        done: Future[StorageHit] = Future()
        done.set_result(StorageHit(0, 0))
        return done

    def _lookup(self, keys: list[bytes], needs_state: bool) -> StorageHit:
        try:
            return find_hit(self.backend, keys, needs_state=needs_state)
        except Exception as e:  # noqa: BLE001 - a lookup failure is a miss, never a dead caller
            with self._cond:
                self._lookup_errors += 1
            _log.warning("storage lookup of %d keys failed: %s: %s", len(keys), type(e).__name__, e)
            return StorageHit(0, 0)

    def _make(
        self,
        kind: JobKind,
        keys: list[bytes],
        host_pages: list[int],
        state: StateCopy | None,
        tag: Any,
        num_tokens: int,
    ) -> _Job:
        if len(keys) != len(host_pages):
            raise ValueError(f"host_pages: {len(host_pages)} pages for {len(keys)} keys")
        if keys and self._kv is None:
            raise ValueError("host_pages: there is no host KV pool")
        for p in host_pages:
            if not 0 <= p < (0 if self._kv is None else len(self._kv)):
                raise ValueError(f"host_pages: page {p} is outside the host KV pool")
        if state is not None and (self._state is None or not 0 <= state.host_slot < len(self._state)):
            raise ValueError(f"state: host slot {state.host_slot} is outside the host state pool")
        job = _Job(next(self._ids), kind, list(keys), list(host_pages), state, tag, num_tokens)
        # Not cancellable: an awaiting task that is cancelled (asyncio.wrap_future propagates it)
        # must not take the result away from the pages it accounts for. Stop a job with revoke().
        job.future.set_running_or_notify_cancel()
        return job

    def _enqueue(self, job: _Job) -> None:
        with self._cond:
            if not self._closed:
                (self._prefetches if job.kind is JobKind.PREFETCH else self._backups).append(job)
                self._cond.notify()
                return
        self._finish(job, JobOutcome.CANCELLED, "storage I/O is shut down")

    # ---- workers -------------------------------------------------------------------------------

    def _spawn(self, slot: int) -> None:
        t = threading.Thread(target=self._worker, args=(slot,), name=f"himamba-storage-io-{slot}", daemon=True)
        self._threads[slot] = t
        t.start()

    def _next(self, slot: int) -> _Job | None:
        with self._cond:
            while not (self._prefetches or self._backups or self._closed):
                self._cond.wait()
            if self._prefetches:
                job = self._prefetches.popleft()
            elif self._backups:
                job = self._backups.popleft()
            else:
                return None
            self._running[slot] = job
            return job

    def _worker(self, slot: int) -> None:
        job: _Job | None = None
        try:
            while (job := self._next(slot)) is not None:
                self._run(job)
                with self._cond:
                    del self._running[slot]
                job = None
        except BaseException as e:  # noqa: BLE001 - a worker must not vanish, whatever escaped
            with self._cond:
                self._running.pop(slot, None)
                self._restarts += 1
                respawn = not self._closed or bool(self._prefetches or self._backups)
                if respawn:
                    self._spawn(slot)
            _log.error(
                "storage I/O worker %d crashed%s; %s",
                slot,
                f" in {job.kind} job {job.id} after {job.num_pages} pages" if job else "",
                "restarted" if respawn else "not restarted (shutting down)",
                exc_info=e,
            )
            if job is not None:
                self._finish(job, JobOutcome.FAILED, f"{type(e).__name__}: {e}")

    def _run(self, job: _Job) -> None:
        job.started = time.monotonic()
        if job.revoked:
            self._finish(job, JobOutcome.REVOKED, None)
            return
        copy = self._prefetch_batch if job.kind is JobKind.PREFETCH else self._backup_batch
        mids = list(job.mid_states)
        start = 0
        stall = self.stall_prefetch_at if job.kind is JobKind.PREFETCH else 0
        step = self.batch_pages if job.kind is JobKind.PREFETCH else self.backup_batch_pages
        while start < len(job.keys):
            if stall and start == stall:
                self._stall(job)
            if job.revoked:
                self._finish(job, JobOutcome.REVOKED, None)
                return
            end = min(start + step, len(job.keys), *(at for at, _ in mids[:1]))
            if start < stall:
                end = min(end, stall)
            n = copy(job.keys[start:end], job.host_pages[start:end])
            job.num_bytes += n * self._kv.shape[1]  # type: ignore[union-attr]
            with job.lock:
                if not job.revoked:
                    job.num_pages += n
            if n < end - start:
                self._finish(job, JobOutcome.PARTIAL, None)
                return
            start = end
            if mids and mids[0][0] == end and not job.revoked:
                self._read_mid_state(job, *mids.pop(0))
        if job.state is not None:
            if job.revoked:
                self._finish(job, JobOutcome.REVOKED, None)
                return
            assert self._state is not None
            slot = memoryview(self._state[job.state.host_slot])
            if job.kind is JobKind.PREFETCH:
                ok = self.backend.get_state(job.state.page_key, slot)
            else:
                ok = self.backend.set_state(job.state.page_key, slot)
            job.num_bytes += slot.nbytes if ok else 0
            job.num_state_bytes += slot.nbytes if ok else 0
            with job.lock:
                job.state_ok = ok and not job.revoked
            if not ok:
                self._finish(job, JobOutcome.PARTIAL, None)
                return
        # A revoke that arrived after the last transfer froze a complete job: it is done.
        with job.lock:
            complete = job.num_pages == len(job.keys) and (job.state is None or job.state_ok)
        self._finish(job, JobOutcome.DONE if complete else JobOutcome.REVOKED, None)

    def _stall(self, job: _Job) -> None:
        """The test hook: hold until the job is revoked (or `_STALL_MAX_S` passed)."""
        _log.warning("test hook: prefetch job %d holds after %d pages until it is revoked", job.id, job.num_pages)
        deadline = time.monotonic() + _STALL_MAX_S
        while not job.revoked and time.monotonic() < deadline:
            time.sleep(0.01)

    def _read_mid_state(self, job: _Job, at: int, state: StateCopy) -> None:
        assert self._state is not None
        slot = memoryview(self._state[state.host_slot])
        ok = self.backend.get_state(state.page_key, slot)  # a miss here only means one less place to stop
        if ok:
            job.num_bytes += slot.nbytes
            job.num_state_bytes += slot.nbytes
        with job.lock:
            if ok and not job.revoked:
                job.states_read.append(at)

    def _prefetch_batch(self, keys: list[bytes], pages: list[int]) -> int:
        assert self._kv is not None
        dest = [memoryview(self._kv[p]) for p in pages]
        n = self.backend.get_pages(keys, dest)
        if not 0 <= n <= len(keys):
            raise RuntimeError(f"{self.backend.name}.get_pages returned {n} for {len(keys)} keys")
        return n

    def _backup_batch(self, keys: list[bytes], pages: list[int]) -> int:
        assert self._kv is not None
        oks = self.backend.set_pages(keys, [memoryview(self._kv[p]) for p in pages], self.page_size)
        if len(oks) != len(keys):
            raise RuntimeError(f"{self.backend.name}.set_pages answered {len(oks)} of {len(keys)} keys")
        n = 0
        while n < len(oks) and oks[n]:
            n += 1
        return n

    def _finish(self, job: _Job, outcome: JobOutcome, error: str | None, release: bool = True) -> None:
        """Complete `job` once: release its budget first, so a caller that sees the result also
        sees the tokens returned."""
        now = time.monotonic()
        with job.lock:
            if job.finished:
                return
            job.finished = True
            result = JobResult(
                job_id=job.id,
                kind=job.kind,
                tag=job.tag,
                outcome=outcome,
                num_pages=job.num_pages,
                state_ok=job.state_ok,
                num_bytes=job.num_bytes,
                num_state_bytes=job.num_state_bytes,
                queued_s=(job.started or now) - job.submitted,
                run_s=0.0 if job.started is None else now - job.started,
                error=error,
                states_read=tuple(job.states_read),
            )
        if release and job.kind is JobKind.PREFETCH:
            try:
                self.budget.release(job.num_tokens)
            except RuntimeError:
                _log.exception("storage: prefetch budget accounting is broken")  # still deliver the result
        with self._cond:
            self._outcomes[job.kind][outcome] += 1
            self._pages[job.kind] += result.num_pages
            self._bytes[job.kind] += result.num_bytes
            self._run_s[job.kind] += result.run_s
        job.future.set_result(result)

    # ---- observing and stopping ----------------------------------------------------------------

    def stats(self) -> IOStats:
        with self._cond:
            return IOStats(
                num_workers=self.num_workers,
                num_worker_restarts=self._restarts,
                num_lookups=self._lookups,
                num_lookup_errors=self._lookup_errors,
                num_queued=len(self._prefetches) + len(self._backups),
                num_running=len(self._running),
                backup_outcomes={str(k): v for k, v in self._outcomes[JobKind.BACKUP].items()},
                prefetch_outcomes={str(k): v for k, v in self._outcomes[JobKind.PREFETCH].items()},
                num_backup_pages=self._pages[JobKind.BACKUP],
                num_backup_bytes=self._bytes[JobKind.BACKUP],
                backup_run_s=self._run_s[JobKind.BACKUP],
                num_prefetch_pages=self._pages[JobKind.PREFETCH],
                num_prefetch_bytes=self._bytes[JobKind.PREFETCH],
                prefetch_run_s=self._run_s[JobKind.PREFETCH],
                budget=self.budget.state(),
            )

    def pending_backups(self) -> int:
        """Backups queued or running: what a flush at shutdown still waits for."""
        with self._cond:
            return len(self._backups) + sum(1 for j in self._running.values() if j.kind is JobKind.BACKUP)

    def close(self, *, drain: bool = False, timeout_s: float = 10.0) -> ShutdownResult:
        """Stop accepting jobs (later submits complete as CANCELLED). Queued jobs run to the end
        with `drain`, else complete as CANCELLED; running prefetches are revoked unless draining.
        Joins the workers for up to `timeout_s`. The backend stays open (its owner closes it)."""
        with self._cond:
            self._closed = True
            cancelled: list[_Job] = []
            if not drain:
                cancelled = [*self._prefetches, *self._backups]
                self._prefetches.clear()
                self._backups.clear()
                running = [j for j in self._running.values() if j.kind is JobKind.PREFETCH]
            else:
                running = []
            self._cond.notify_all()
        self._lookup_pool.shutdown(wait=False, cancel_futures=True)
        for job in cancelled:
            self._finish(job, JobOutcome.CANCELLED, "storage I/O is shut down")
        for job in running:
            JobHandle(job).revoke()
        deadline = time.monotonic() + timeout_s
        while True:
            with self._cond:
                alive = [t for t in self._threads.values() if t.is_alive() and t is not threading.current_thread()]
            left = deadline - time.monotonic()
            if not alive or left <= 0:
                break
            alive[0].join(left)
        if alive:
            _log.warning("storage I/O: %d worker(s) still busy after %.1f s", len(alive), timeout_s)
        backups = sum(1 for j in cancelled if j.kind is JobKind.BACKUP)
        return ShutdownResult(len(cancelled), len(alive), backups)


def _rows(t: torch.Tensor | None, name: str) -> np.ndarray | None:
    """A numpy view of a 2-D uint8 pool, so that each row is a writable buffer (zero copy)."""
    if t is None:
        return None
    if t.dtype != torch.uint8 or t.dim() != 2 or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name}: must be a contiguous 2-D uint8 CPU tensor, got {t.dtype} {tuple(t.shape)}")
    return t.numpy()
