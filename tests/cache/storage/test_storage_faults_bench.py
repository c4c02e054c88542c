"""The fault-injection wrapper, the bandwidth probes, the backend factory, and shared host pools."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from himamba.bench.storage_bandwidth import machine_bandwidth, measure_storage_bandwidth
from himamba.common.host_pool import HostPoolLayout, StateComponentLayout, open_host_pools
from himamba.services.cache.storage.base import StorageError
from himamba.services.cache.storage.factory import open_backend
from himamba.services.cache.storage.file import FileBackend
from himamba.services.cache.storage.flaky import FlakyBackend
from himamba.services.cache.storage.io_workers import JobOutcome, StateCopy, StorageIO

FP = bytes(range(32))
PAGE = 64


def _keys(n: int) -> list[bytes]:
    return [bytes([7, i]) * 16 for i in range(n)]


def _stored(tmp_path: Path, n: int) -> tuple[FileBackend, np.ndarray]:
    b = FileBackend(FP, tmp_path)
    pages = np.random.default_rng(3).integers(0, 256, size=(n, PAGE), dtype=np.uint8)
    assert all(b.set_pages(_keys(n), [memoryview(r) for r in pages]))
    return b, pages


def test_no_faults_passes_everything_through(tmp_path: Path) -> None:
    inner, pages = _stored(tmp_path, 4)
    flaky = FlakyBackend(inner, fail_rate=0.0, seed=1)
    out = np.zeros_like(pages)
    assert flaky.get_pages(_keys(4), [memoryview(r) for r in out]) == 4 and np.array_equal(out, pages)
    assert flaky.exists(_keys(4)) == 4 and flaky.num_injected == 0


def test_loud_faults_raise_storage_error(tmp_path: Path) -> None:
    inner, _ = _stored(tmp_path, 2)
    flaky = FlakyBackend(inner, fail_rate=1.0, seed=1, raise_share=1.0)
    with pytest.raises(StorageError, match="injected"):
        flaky.exists(_keys(2))
    with pytest.raises(StorageError):
        flaky.set_state(_keys(1)[0], b"x")


def test_quiet_faults_lose_pages_and_scribble_only_past_the_reported_count(tmp_path: Path) -> None:
    inner, pages = _stored(tmp_path, 6)
    flaky = FlakyBackend(inner, fail_rate=1.0, seed=5, raise_share=0.0)
    out = np.zeros_like(pages)
    n = flaky.get_pages(_keys(6), [memoryview(r) for r in out])
    assert n < 6
    assert np.array_equal(out[:n], pages[:n]) and (out[n:] == 0xA5).all()
    assert flaky.set_pages(_keys(2), [memoryview(r) for r in pages[:2]]) == [False, False]
    assert flaky.exists(_keys(6)) < 6
    assert flaky.num_injected == 3


def test_the_same_seed_fails_the_same_calls(tmp_path: Path) -> None:
    inner, _ = _stored(tmp_path, 3)

    def pattern(seed: int) -> list[int]:
        f = FlakyBackend(inner, fail_rate=0.5, seed=seed, raise_share=0.0)
        return [f.exists(_keys(3)) for _ in range(30)]

    assert pattern(11) == pattern(11)
    assert pattern(11) != pattern(12)


def test_storage_bandwidth_moves_every_page(tmp_path: Path) -> None:
    out = measure_storage_bandwidth(FileBackend(FP, tmp_path), page_bytes=4096, n_pages=20)
    assert out["pages_written"] == out["pages_read"] == 20
    assert out["write_mb_s"] > 0 and out["read_mb_s"] > 0


def test_machine_bandwidth_reports_disk_and_memory(tmp_path: Path) -> None:
    out = machine_bandwidth(tmp_path, nbytes=1 << 20)
    assert set(out) == {"disk_write_fsync_mb_s", "disk_read_mb_s", "file_creates_per_s", "memcpy_gb_s"}
    assert all(v > 0 for v in out.values())
    assert not list(tmp_path.iterdir())  # its temp files are gone


def test_open_backend_by_name(tmp_path: Path) -> None:
    assert open_backend("none", FP) is None
    b = open_backend("file", FP, directory=tmp_path)
    assert isinstance(b, FileBackend) and b.dir == tmp_path / FP.hex()
    with pytest.raises(ValueError, match="hicache_storage_backend"):
        open_backend("floppy", FP)


def test_prefetch_lands_in_shared_host_pools(tmp_path: Path) -> None:
    tag = f"himamba-test-{os.getpid()}"
    layout = HostPoolLayout(
        kv_name=f"{tag}-kv",
        num_pages=8,
        page_size=4,
        num_kv_layers=2,
        num_kv_heads=2,
        head_dim=4,
        state_name=f"{tag}-state",
        num_slots=2,
        state_components=[StateComponentLayout(0, "ssm", (3, 4), "float32", 0)],
        state_slot_bytes=48,
    )
    pools = open_host_pools(layout, create=True)
    try:
        assert pools.kv is not None and pools.kv_bytes is not None
        pools.kv[:4].normal_()
        pools.state[(0, "ssm")][0].normal_()
        io = StorageIO(
            FileBackend(FP, tmp_path), pools.kv_bytes, pools.state_bytes, page_size=4, prefetch_budget_tokens=64
        )
        keys = _keys(4)
        assert io.submit_backup(keys, [0, 1, 2, 3], StateCopy(keys[3], 0)).future.result(10).outcome is JobOutcome.DONE
        r = io.submit_prefetch(keys, [4, 5, 6, 7], StateCopy(keys[3], 1)).future.result(10)
        assert r.outcome is JobOutcome.DONE and r.state_ok
        # Seen through the typed views of the same shared memory.
        assert bool((pools.kv[4:8] == pools.kv[0:4]).all())
        assert bool((pools.state[(0, "ssm")][1] == pools.state[(0, "ssm")][0]).all())
        io.close()
    finally:
        pools.close(unlink=True)
