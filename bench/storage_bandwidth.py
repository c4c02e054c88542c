"""Bandwidth probes for `himamba bench cache --tiers ...,storage`: what a backend moves, next to
what this machine's disk and memory can move (so a number can be read as near or far from the
hardware)."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np

from himamba.services.cache.storage.base import StorageBackend
from himamba.services.cache.storage.io_workers import BACKUP_BATCH_PAGES, PREFETCH_BATCH_PAGES

__all__ = ["disk_probe", "drop_page_cache", "machine_bandwidth", "measure_storage_bandwidth"]

_MB = 1e6
_CREATES = 64


def drop_page_cache(directory: Path) -> None:
    """Write back and drop from the OS page cache every file under `directory`, so the next read
    comes from the disk (a cold read). Not timed by the callers."""
    for root, _dirs, files in os.walk(directory):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)  # dirty pages are not dropped: write them back first
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            finally:
                os.close(fd)


def disk_probe(directory: Path, page_bytes: int, n_pages: int, fsync: bool) -> dict[str, float]:
    """What the disk itself does with the backend's work: `n_pages` writes of `page_bytes` to one
    file in `directory` (fsync after each backup batch's worth when the backend fsyncs), then
    the file read back cold in page-sized reads. Keys: probe_write_mb_s, probe_read_mb_s, and the
    CPU seconds of each (probe_write_cpu_s, probe_read_cpu_s)."""
    # Distinct source and destination pages, as the backend's (one reused buffer would stay in
    # the CPU cache and flatter the probe).
    src = np.random.default_rng(1).integers(0, 256, size=(n_pages, page_bytes), dtype=np.uint8)
    dst = np.zeros_like(src)
    with tempfile.TemporaryDirectory(dir=directory, prefix="himamba-probe-") as tmp:
        path = os.path.join(tmp, "probe")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            t0, c0 = time.perf_counter(), time.thread_time()
            for i in range(n_pages):
                os.write(fd, memoryview(src[i]))
                if fsync and (i % BACKUP_BATCH_PAGES == BACKUP_BATCH_PAGES - 1 or i == n_pages - 1):
                    os.fdatasync(fd)
            t_write, c_write = time.perf_counter() - t0, time.thread_time() - c0
        finally:
            os.close(fd)
        drop_page_cache(Path(tmp))
        with open(path, "rb", buffering=0) as f:
            t0, c0 = time.perf_counter(), time.thread_time()
            got = 0
            for i in range(n_pages):
                got += f.readinto(memoryview(dst[i]))
            t_read, c_read = time.perf_counter() - t0, time.thread_time() - c0
    return {
        "probe_write_mb_s": n_pages * page_bytes / _MB / max(t_write, 1e-9),
        "probe_read_mb_s": got / _MB / max(t_read, 1e-9),
        "probe_write_cpu_s": c_write,
        "probe_read_cpu_s": c_read,
    }


def measure_storage_bandwidth(
    backend: StorageBackend, page_bytes: int, n_pages: int, cold: Path | None = None
) -> dict[str, float]:
    """Write `n_pages` pages of `page_bytes` under fresh random keys, then read them back, in
    the I/O workers' batches (backup and prefetch). Use a scratch store: the pages stay there. With `cold`
    (a file backend's directory) the reads come from the disk: the directory is dropped from the
    OS page cache first (untimed); else a file backend reads from the page cache. Keys: write_mb_s,
    read_mb_s (payload bytes), write_cpu_s, read_cpu_s (the calling thread's CPU seconds: a
    figure a loaded machine disturbs far less than the wall clock), pages_written, pages_read,
    page_bytes, num_pages."""
    if page_bytes <= 0 or n_pages <= 0:
        raise ValueError(f"page_bytes, n_pages: must be > 0, got {page_bytes}, {n_pages}")
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, size=(n_pages, page_bytes), dtype=np.uint8)
    dst = np.zeros_like(src)
    keys = [os.urandom(32) for _ in range(n_pages)]
    written = 0
    t0, c0 = time.perf_counter(), time.thread_time()
    wb, rb = BACKUP_BATCH_PAGES, PREFETCH_BATCH_PAGES
    for i in range(0, n_pages, wb):
        oks = backend.set_pages(keys[i : i + wb], [memoryview(src[j]) for j in range(i, min(i + wb, n_pages))])
        written += sum(oks)
    t_write, c_write = time.perf_counter() - t0, time.thread_time() - c0
    if cold is not None:
        drop_page_cache(cold)
    read = 0
    t0, c0 = time.perf_counter(), time.thread_time()
    for i in range(0, n_pages, rb):
        read += backend.get_pages(keys[i : i + rb], [memoryview(dst[j]) for j in range(i, min(i + rb, n_pages))])
    t_read, c_read = time.perf_counter() - t0, time.thread_time() - c0
    return {
        "write_mb_s": written * page_bytes / _MB / max(t_write, 1e-9),
        "read_mb_s": read * page_bytes / _MB / max(t_read, 1e-9),
        "write_cpu_s": c_write,
        "read_cpu_s": c_read,
        "pages_written": float(written),
        "pages_read": float(read),
        "page_bytes": float(page_bytes),
        "num_pages": float(n_pages),
    }


def machine_bandwidth(directory: Path | None = None, nbytes: int = 64 << 20) -> dict[str, float]:
    """Sequential write of `nbytes` with fsync and read back (after asking the OS to drop the file
    from its cache) in a temp file under `directory`, small-file creation (4 KiB each), and memcpy
    of `nbytes`. Keys: disk_write_fsync_mb_s, disk_read_mb_s, file_creates_per_s, memcpy_gb_s."""
    if nbytes <= 0:
        raise ValueError(f"nbytes: must be > 0, got {nbytes}")
    chunk = np.random.default_rng(0).integers(0, 256, size=min(nbytes, 4 << 20), dtype=np.uint8)
    with tempfile.TemporaryDirectory(dir=directory, prefix="himamba-bw-") as tmp:
        path = os.path.join(tmp, "probe")
        t0 = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            done = 0
            while done < nbytes:
                done += f.write(memoryview(chunk)[: nbytes - done])
            os.fsync(f.fileno())
        t_write = time.perf_counter() - t0
        buf = bytearray(len(chunk))
        with open(path, "rb", buffering=0) as f:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            got = 0
            while (n := f.readinto(buf)) > 0:
                got += n
            t_read = time.perf_counter() - t0
        # Small-file creation: what a one-file-per-value store would be bound by.
        t0 = time.perf_counter()
        for i in range(_CREATES):
            fd = os.open(os.path.join(tmp, f"c{i}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(fd, chunk[:4096])
            os.close(fd)
        t_create = time.perf_counter() - t0
    a = np.ones(nbytes, dtype=np.uint8)
    b = np.empty_like(a)
    np.copyto(b, a)  # fault the pages in before timing
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return {
        "disk_write_fsync_mb_s": nbytes / _MB / max(t_write, 1e-9),
        "disk_read_mb_s": got / _MB / max(t_read, 1e-9),
        "memcpy_gb_s": nbytes / 1e9 / max(best, 1e-9),
        "file_creates_per_s": _CREATES / max(t_create, 1e-9),
    }
