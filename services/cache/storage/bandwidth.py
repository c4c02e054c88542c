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

__all__ = ["machine_bandwidth", "measure_storage_bandwidth"]

_MB = 1e6
_BATCH = 8
_CREATES = 64


def measure_storage_bandwidth(backend: StorageBackend, page_bytes: int, n_pages: int) -> dict[str, float]:
    """Write `n_pages` pages of `page_bytes` under fresh random keys, then read them back, in
    batches of 8 (as the I/O workers do). Use a scratch store: the pages stay there. Reads follow
    the writes at once, so a file backend reads from the OS page cache. Keys: write_mb_s,
    read_mb_s (payload bytes), pages_written, pages_read, page_bytes, num_pages."""
    if page_bytes <= 0 or n_pages <= 0:
        raise ValueError(f"page_bytes, n_pages: must be > 0, got {page_bytes}, {n_pages}")
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, size=(n_pages, page_bytes), dtype=np.uint8)
    dst = np.zeros_like(src)
    keys = [os.urandom(32) for _ in range(n_pages)]
    written = 0
    t0 = time.perf_counter()
    for i in range(0, n_pages, _BATCH):
        oks = backend.set_pages(keys[i : i + _BATCH], [memoryview(src[j]) for j in range(i, min(i + _BATCH, n_pages))])
        written += sum(oks)
    t_write = time.perf_counter() - t0
    read = 0
    t0 = time.perf_counter()
    for i in range(0, n_pages, _BATCH):
        read += backend.get_pages(
            keys[i : i + _BATCH], [memoryview(dst[j]) for j in range(i, min(i + _BATCH, n_pages))]
        )
    t_read = time.perf_counter() - t0
    return {
        "write_mb_s": written * page_bytes / _MB / max(t_write, 1e-9),
        "read_mb_s": read * page_bytes / _MB / max(t_read, 1e-9),
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
        # The file backend creates one file per page: on some disks that, not bandwidth, is the limit.
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
