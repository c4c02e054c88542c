"""Storage I/O workers: jobs complete, crashes are supervised, revocation, the budget, shutdown."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from himamba.services.cache.storage.base import Buffer, StorageBackend, StorageHit
from himamba.services.cache.storage.file import FileBackend
from himamba.services.cache.storage.flaky import FlakyBackend
from himamba.services.cache.storage.io_workers import JobOutcome, JobResult, StateCopy, StorageIO

FP = bytes(range(32))
PAGE_BYTES = 128
SLOT_BYTES = 40
PAGE_SIZE = 4
WAIT_S = 10.0


def _keys(n: int, salt: int = 0) -> list[bytes]:
    return [bytes([salt, i]) * 16 for i in range(n)]


def _pools(num_pages: int = 32, num_slots: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    kv = torch.zeros(num_pages, PAGE_BYTES, dtype=torch.uint8)
    state = torch.zeros(num_slots, SLOT_BYTES, dtype=torch.uint8)
    return kv, state


def _fill(kv: torch.Tensor, pages: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in pages:
        kv[p] = torch.randint(0, 256, (PAGE_BYTES,), dtype=torch.uint8, generator=g)


def _result(handle) -> JobResult:  # type: ignore[no-untyped-def]
    return handle.future.result(timeout=WAIT_S)


def _wait_until(cond, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def _budget_is_idle(io: StorageIO) -> bool:
    b = io.budget.state()
    return b.in_flight_tokens == 0 and b.num_jobs_in_flight == 0


class Gated(StorageBackend):
    """Delegates to `inner`, but each data call waits for a permit; records the call order."""

    name = "gated"

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner.fingerprint)
        self.inner = inner
        self.permits = threading.Semaphore(0)
        self.entered = 0
        self.calls: list[str] = []
        self._lock = threading.Lock()

    def _gate(self, what: str) -> None:
        with self._lock:
            self.entered += 1
            self.calls.append(what)
        assert self.permits.acquire(timeout=WAIT_S), "test never released the gate"

    def exists(self, keys: Sequence[bytes]) -> int:
        return self.inner.exists(keys)

    def exists_states(self, keys: Sequence[bytes]) -> list[bool]:
        return self.inner.exists_states(keys)

    def get_pages(self, keys: Sequence[bytes], dest: Sequence[Buffer]) -> int:
        self._gate("get")
        return self.inner.get_pages(keys, dest)

    def set_pages(self, keys: Sequence[bytes], blobs: Sequence[Buffer], token_count: int = 0) -> list[bool]:
        self._gate("set")
        return self.inner.set_pages(keys, blobs, token_count)

    def get_state(self, key: bytes, dest: Buffer) -> bool:
        return self.inner.get_state(key, dest)

    def set_state(self, key: bytes, blob: Buffer) -> bool:
        return self.inner.set_state(key, blob)

    def close(self) -> None:
        self.inner.close()


class Exploding(FileBackend):
    """A file backend whose get_pages raises on one key, and set_pages answers None on another
    (the sglang bug that killed its storage thread for good)."""

    bad_get: bytes = b""
    bad_set: bytes = b""

    def get_pages(self, keys: Sequence[bytes], dest: Sequence[Buffer]) -> int:
        if self.bad_get in keys:
            raise OSError("disk on fire")
        return super().get_pages(keys, dest)

    def set_pages(self, keys, blobs, token_count=0):  # type: ignore[no-untyped-def]
        if self.bad_set in keys:
            return None
        return super().set_pages(keys, blobs, token_count)


def test_backup_then_prefetch_round_trips_pages_and_state(tmp_path: Path) -> None:
    kv, state = _pools()
    _fill(kv, list(range(6)), seed=1)
    state[1] = torch.arange(SLOT_BYTES, dtype=torch.uint8)
    io = StorageIO(FileBackend(FP, tmp_path), kv, state, page_size=PAGE_SIZE, prefetch_budget_tokens=64, batch_pages=4)
    keys = _keys(6)
    backup = _result(io.submit_backup(keys, list(range(6)), StateCopy(keys[-1], 1), tag="node-7"))
    assert (backup.outcome, backup.num_pages, backup.state_ok, backup.tag) == (JobOutcome.DONE, 6, True, "node-7")
    assert backup.num_bytes == 6 * PAGE_BYTES + SLOT_BYTES and backup.error is None

    fetched = _result(io.submit_prefetch(keys, list(range(10, 16)), StateCopy(keys[-1], 3)))
    assert (fetched.outcome, fetched.num_pages, fetched.state_ok) == (JobOutcome.DONE, 6, True)
    assert torch.equal(kv[10:16], kv[0:6]) and torch.equal(state[3], state[1])
    s = io.stats()
    assert s.backup_outcomes["done"] == 1 and s.prefetch_outcomes["done"] == 1
    assert s.num_prefetch_pages == 6 and s.num_backup_bytes == backup.num_bytes
    assert _budget_is_idle(io)
    assert io.close() == (0, 0, 0)


def test_the_event_loop_can_await_a_job(tmp_path: Path) -> None:
    kv, state = _pools()
    io = StorageIO(FileBackend(FP, tmp_path), kv, state, page_size=PAGE_SIZE, prefetch_budget_tokens=64)

    async def main() -> JobResult:
        return await asyncio.wait_for(asyncio.wrap_future(io.submit_backup(_keys(3), [0, 1, 2]).future), WAIT_S)

    assert asyncio.run(main()).outcome is JobOutcome.DONE
    io.close()


def test_a_prefetch_stops_at_the_first_missing_page_and_skips_the_state(tmp_path: Path) -> None:
    kv, state = _pools()
    backend = FileBackend(FP, tmp_path)
    keys = _keys(8)
    backend.set_pages(keys[:5], [memoryview(kv[i].numpy()) for i in range(5)])
    backend.set_state(keys[-1], b"s" * SLOT_BYTES)
    io = StorageIO(backend, kv, state, page_size=PAGE_SIZE, prefetch_budget_tokens=64, batch_pages=3)
    r = _result(io.submit_prefetch(keys, list(range(8, 16)), StateCopy(keys[-1], 0)))
    assert (r.outcome, r.num_pages, r.state_ok) == (JobOutcome.PARTIAL, 5, False)
    assert not state[0].any()
    assert _budget_is_idle(io)
    io.close()


def test_a_job_that_raises_fails_alone_and_its_worker_is_replaced(tmp_path: Path) -> None:
    kv, state = _pools()
    keys = _keys(6)
    backend = Exploding(FP, tmp_path)
    backend.bad_get, backend.bad_set = keys[4], keys[5]
    io = StorageIO(backend, kv, state, page_size=PAGE_SIZE, prefetch_budget_tokens=64, num_workers=2, batch_pages=2)
    assert _result(io.submit_backup(keys[:5], list(range(5)))).num_pages == 5

    crashed = _result(io.submit_prefetch(keys[:5], list(range(10, 15))))
    assert crashed.outcome is JobOutcome.FAILED and crashed.num_pages == 4  # two whole batches first
    assert "disk on fire" in (crashed.error or "")
    returned_none = _result(io.submit_backup(keys[5:], [5]))
    assert returned_none.outcome is JobOutcome.FAILED and returned_none.num_pages == 0

    s = io.stats()
    assert s.num_worker_restarts == 2
    assert s.prefetch_outcomes["failed"] == 1 and s.backup_outcomes["failed"] == 1
    _wait_until(lambda: sum(t.is_alive() for t in io._threads.values()) == 2, "two live workers")
    # The pool keeps serving, with every worker.
    handles = [io.submit_prefetch(keys[:4], list(range(16 + 4 * i, 20 + 4 * i))) for i in range(3)]
    assert [_result(h).outcome for h in handles] == [JobOutcome.DONE] * 3
    assert _budget_is_idle(io)
    io.close()


def test_revoking_a_running_prefetch_freezes_its_completed_pages(tmp_path: Path) -> None:
    kv, state = _pools()
    inner = FileBackend(FP, tmp_path)
    keys = _keys(10)
    _fill(kv, list(range(10)), seed=2)
    inner.set_pages(keys, [memoryview(kv[i].numpy()) for i in range(10)])
    gated = Gated(inner)
    io = StorageIO(gated, kv, state, page_size=PAGE_SIZE, prefetch_budget_tokens=64, num_workers=1, batch_pages=1)
    handle = io.submit_prefetch(keys, list(range(20, 30)), StateCopy(keys[-1], 0))
    gated.permits.release(2)
    _wait_until(lambda: handle.num_pages == 2 and gated.entered == 3, "two pages and a third call in flight")
    assert handle.revoke() == 2
    gated.permits.release(1)  # the in-flight page lands, but after the revoke: discarded
    r = _result(handle)
    assert (r.outcome, r.num_pages, r.state_ok) == (JobOutcome.REVOKED, 2, False)
    assert gated.entered == 3  # no I/O after the revoke
    assert torch.equal(kv[20:22], kv[0:2])
    assert handle.revoke() == 2  # revoking a finished job changes nothing
    assert _budget_is_idle(io)
    io.close()


def test_a_job_revoked_while_queued_never_touches_storage(tmp_path: Path) -> None:
    kv, state = _pools()
    gated = Gated(FileBackend(FP, tmp_path))
    io = StorageIO(gated, kv, state, page_size=PAGE_SIZE, prefetch_budget_tokens=64, num_workers=1)
    blocker = io.submit_backup(_keys(1), [0])
    _wait_until(lambda: gated.entered == 1, "the blocker to start")
    queued = io.submit_prefetch(_keys(2, salt=1), [1, 2])
    assert queued.revoke() == 0
    gated.permits.release(1)
    r = _result(queued)
    assert (r.outcome, r.num_pages) == (JobOutcome.REVOKED, 0)
    assert _result(blocker).outcome is JobOutcome.DONE
    assert gated.calls == ["set"]
    assert _budget_is_idle(io)
    io.close()


def test_prefetches_run_before_queued_backups(tmp_path: Path) -> None:
    kv, state = _pools()
    gated = Gated(FileBackend(FP, tmp_path))
    io = StorageIO(gated, kv, state, page_size=PAGE_SIZE, prefetch_budget_tokens=64, num_workers=1)
    first = io.submit_backup(_keys(1), [0])
    _wait_until(lambda: gated.entered == 1, "the first backup to start")
    later_backup = io.submit_backup(_keys(1, salt=1), [1])
    prefetch = io.submit_prefetch(_keys(1, salt=2), [2])
    gated.permits.release(3)
    for h in (first, later_backup, prefetch):
        _result(h)
    assert gated.calls == ["set", "get", "set"]
    io.close()


def test_the_budget_refuses_what_does_not_fit_but_never_starves_an_idle_pool(tmp_path: Path) -> None:
    kv, state = _pools()
    gated = Gated(FileBackend(FP, tmp_path))
    io = StorageIO(gated, kv, state, page_size=PAGE_SIZE, prefetch_budget_tokens=0, num_workers=1, batch_pages=2)
    assert io.budget.capacity_tokens == 2 * PAGE_SIZE  # floored at one batch, never zero
    big = io.submit_prefetch(_keys(5), list(range(5)))  # 20 tokens > capacity, admitted: nothing in flight
    assert io.budget.state().in_flight_tokens == 5 * PAGE_SIZE
    refused = _result(io.submit_prefetch(_keys(1, salt=1), [6]))
    assert refused.outcome is JobOutcome.REFUSED and refused.num_pages == 0
    assert io.budget.state().num_refused == 1
    gated.permits.release(10)
    assert _result(big).outcome is JobOutcome.PARTIAL  # nothing stored under those keys
    assert _budget_is_idle(io)
    io.close()


@pytest.mark.parametrize("seed", range(4))
def test_every_job_ends_and_the_budget_returns_to_zero_under_faults(tmp_path: Path, seed: int) -> None:
    kv, state = _pools(num_pages=64)
    inner = FileBackend(FP, tmp_path)
    keys = _keys(16)
    inner.set_pages(keys, [memoryview(kv[i].numpy()) for i in range(16)])
    inner.set_state(keys[-1], b"s" * SLOT_BYTES)
    flaky = FlakyBackend(inner, fail_rate=0.3, seed=seed)
    io = StorageIO(flaky, kv, state, page_size=PAGE_SIZE, prefetch_budget_tokens=96, num_workers=2, batch_pages=3)
    handles = []
    for i in range(24):
        n = 1 + (i * 7 + seed) % 16
        if i % 3 == 2:
            handles.append(io.submit_backup(keys[:n], list(range(n)), StateCopy(keys[n - 1], 1)))
        else:
            handles.append(io.submit_prefetch(keys[:n], list(range(32, 32 + n)), StateCopy(keys[-1], 2)))
        if i % 5 == 4:
            handles[-2].revoke()
    shutdown = io.close(drain=seed % 2 == 0, timeout_s=WAIT_S)
    results = [_result(h) for h in handles]
    assert shutdown.num_unjoined == 0
    backups = [r for i, r in enumerate(results) if i % 3 == 2]
    assert shutdown.num_cancelled_backups == sum(r.outcome is JobOutcome.CANCELLED for r in backups)
    assert io.pending_backups() == 0
    assert _budget_is_idle(io)
    s = io.stats()
    assert sum(s.prefetch_outcomes.values()) + sum(s.backup_outcomes.values()) == len(handles)
    assert s.num_worker_restarts == sum(r.outcome is JobOutcome.FAILED for r in results)
    assert s.num_queued == 0 and s.num_running == 0
    for r in results:
        assert 0 <= r.num_pages <= 16
        assert (r.outcome is JobOutcome.FAILED) == (r.error is not None and "injected" in r.error)


def test_shutdown_cancels_queued_jobs_and_revokes_running_prefetches(tmp_path: Path) -> None:
    kv, state = _pools()
    inner = FileBackend(FP, tmp_path)
    keys = _keys(4)
    inner.set_pages(keys, [memoryview(kv[i].numpy()) for i in range(4)])
    gated = Gated(inner)
    io = StorageIO(gated, kv, state, page_size=PAGE_SIZE, prefetch_budget_tokens=64, num_workers=1, batch_pages=1)
    running = io.submit_prefetch(keys, [10, 11, 12, 13])
    _wait_until(lambda: gated.entered == 1, "the prefetch to start")
    queued = [io.submit_backup(keys[:1], [0]), io.submit_prefetch(keys[:1], [20])]
    closer = threading.Thread(target=lambda: out.append(io.close(timeout_s=WAIT_S)))
    out: list = []
    closer.start()
    _wait_until(lambda: all(h.future.done() for h in queued), "queued jobs to be cancelled")
    gated.permits.release(1)
    closer.join(WAIT_S)
    assert out and out[0].num_cancelled == 2 and out[0].num_unjoined == 0
    assert [_result(h).outcome for h in queued] == [JobOutcome.CANCELLED] * 2
    r = _result(running)
    assert (r.outcome, r.num_pages) == (JobOutcome.REVOKED, 0)  # its page landed after the revoke
    assert gated.entered == 1
    late = _result(io.submit_backup(keys[:1], [0]))
    assert late.outcome is JobOutcome.CANCELLED
    assert _budget_is_idle(io)


def test_a_draining_shutdown_finishes_queued_jobs(tmp_path: Path) -> None:
    kv, state = _pools()
    io = StorageIO(FileBackend(FP, tmp_path), kv, state, page_size=PAGE_SIZE, prefetch_budget_tokens=64, num_workers=1)
    handles = [io.submit_backup(_keys(2, salt=i), [2 * i, 2 * i + 1]) for i in range(5)]
    assert io.close(drain=True, timeout_s=WAIT_S) == (0, 0, 0)
    assert [_result(h).outcome for h in handles] == [JobOutcome.DONE] * 5


def test_bad_submissions_raise_value_error(tmp_path: Path) -> None:
    kv, _ = _pools(num_pages=4)
    io = StorageIO(FileBackend(FP, tmp_path), kv, None, page_size=PAGE_SIZE, prefetch_budget_tokens=64)
    with pytest.raises(ValueError, match="host_pages"):
        io.submit_backup(_keys(2), [0])
    with pytest.raises(ValueError, match="host_pages"):
        io.submit_prefetch(_keys(1), [4])
    with pytest.raises(ValueError, match="state"):
        io.submit_backup(_keys(1), [0], StateCopy(_keys(1)[0], 0))
    with pytest.raises(ValueError, match="kv_bytes"):
        StorageIO(io.backend, kv.float(), None, page_size=PAGE_SIZE, prefetch_budget_tokens=64)
    assert _budget_is_idle(io)
    io.close()


def test_cancelling_an_awaiting_task_does_not_cancel_the_job(tmp_path: Path) -> None:
    kv, state = _pools()
    gated = Gated(FileBackend(FP, tmp_path))
    io = StorageIO(gated, kv, state, page_size=PAGE_SIZE, prefetch_budget_tokens=64, num_workers=1)
    handle = io.submit_prefetch(_keys(1), [0])

    async def impatient() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.wrap_future(handle.future), 0.01)

    asyncio.run(impatient())
    assert not handle.future.cancelled()
    gated.permits.release(1)
    assert _result(handle).outcome is JobOutcome.PARTIAL  # nothing stored: a miss, delivered
    assert io.stats().num_worker_restarts == 0
    assert _budget_is_idle(io)
    io.close()


def test_lookup_answers_the_hybrid_hit_and_a_failing_store_is_a_counted_miss(tmp_path: Path) -> None:
    kv, state = _pools()
    inner = FileBackend(FP, tmp_path)
    keys = _keys(5)
    inner.set_pages(keys[:4], [memoryview(kv[i].numpy()) for i in range(4)])
    inner.set_state(keys[1], b"s" * SLOT_BYTES)
    io = StorageIO(inner, kv, state, page_size=PAGE_SIZE, prefetch_budget_tokens=64)
    assert io.lookup(keys, needs_state=True).result(WAIT_S) == StorageHit(4, 2, (2,))
    assert io.lookup(keys, needs_state=False).result(WAIT_S) == StorageHit(4, 4)
    io.close()

    broken = StorageIO(
        FlakyBackend(inner, 1.0, seed=0, raise_share=1.0), kv, state, page_size=4, prefetch_budget_tokens=64
    )
    assert broken.lookup(keys, needs_state=True).result(WAIT_S) == StorageHit(0, 0)
    assert (broken.stats().num_lookups, broken.stats().num_lookup_errors) == (1, 1)
    broken.close()
    assert broken.lookup(keys, needs_state=True).result(WAIT_S) == StorageHit(0, 0)
