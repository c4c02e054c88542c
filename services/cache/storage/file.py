"""The `file` storage backend (the default, embedded): one file per value under a directory.

Layout: `<root>/<fingerprint hex>/<first 2 hex digits of the key>/<key hex>.kv|.state`. The
fingerprint directory keeps models apart; the fan-out keeps directories small. Each file is
`header || payload` (see base.py), written to a temp file and renamed over the final name, so a
reader sees a whole old file, a whole new file, or nothing; a torn or flipped file fails its
checksum, counts as corrupt, and is deleted. Files survive restarts: a new instance on the same
directory serves what an earlier one wrote.

Recency is the file's mtime, refreshed by `exists`, `get_*` and a skipped `set_*`. With a size cap,
a write that would exceed it first evicts least-recently-used files down to `low_watermark` of the
cap (one thread evicts; writers that arrive meanwhile are refused, as a full remote store would).
The byte count is this process's estimate, re-synced by each eviction scan; other processes
sharing the directory are seen at the next scan.
"""

from __future__ import annotations

import io
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from himamba.services.cache.storage.base import (
    HEADER_BYTES,
    Buffer,
    StorageBackend,
    StorageStats,
    ValueKind,
    check_batch,
)

__all__ = ["FileBackend", "default_storage_dir"]

_log = logging.getLogger("himamba.cache.storage")
_SUFFIX = {ValueKind.KV: ".kv", ValueKind.STATE: ".state"}
_STALE_TMP_S = 600.0  # a temp file this old belongs to a writer that died


def default_storage_dir() -> Path:
    """`$XDG_CACHE_HOME/himamba/storage`, or `~/.cache/himamba/storage`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "himamba" / "storage"


class FileBackend(StorageBackend):
    """Values as files under `root/<fingerprint hex>/`; see the module docstring.

    `max_bytes` caps the directory (0: no cap); `fsync` makes each write durable before it is
    acknowledged (off by default: a value lost in a crash is only a cache miss, and a torn one is
    caught by its checksum). With a cap, opening scans the directory once to count its bytes."""

    name = "file"

    def __init__(
        self,
        fingerprint: bytes,
        root: Path | None = None,
        *,
        max_bytes: int = 0,
        fsync: bool = False,
        low_watermark: float = 0.9,
    ) -> None:
        super().__init__(fingerprint)
        if max_bytes < 0:
            raise ValueError(f"max_bytes: must be >= 0, got {max_bytes}")
        if not 0.0 < low_watermark <= 1.0:
            raise ValueError(f"low_watermark: must be in (0, 1], got {low_watermark}")
        self.dir = Path(root if root is not None else default_storage_dir()) / fingerprint.hex()
        self.max_bytes = max_bytes
        self.fsync = fsync
        self.low_watermark = low_watermark
        self._lock = threading.Lock()  # guards _used, _logged, _closed
        self._evict_lock = threading.Lock()
        self._used = 0
        self._logged: set[str] = set()
        self._closed = False
        self._made_dirs: set[str] = set()  # fan-out dirs known to exist (a hint; set.add is atomic)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._log_once("mkdir", f"storage dir {self.dir} unusable, every write will be refused: {e}")
        if max_bytes:
            self._scan_and_evict(max_bytes)

    # ---- paths ---------------------------------------------------------------------------------

    def _path(self, key: bytes, kind: ValueKind) -> str:
        h = key.hex()
        return os.path.join(self.dir, h[:2], h + _SUFFIX[kind])

    def _create(self, path: str, tmp: str) -> int:
        """Open `tmp` for writing, creating the fan-out directory on first use (again if someone
        removed it)."""
        parent = os.path.dirname(path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        if parent in self._made_dirs:
            try:
                return os.open(tmp, flags, 0o644)
            except FileNotFoundError:
                self._made_dirs.discard(parent)
        os.makedirs(parent, exist_ok=True)
        self._made_dirs.add(parent)
        return os.open(tmp, flags, 0o644)

    # ---- the contract --------------------------------------------------------------------------

    def exists(self, keys: Sequence[bytes]) -> int:
        self._check_open()
        n = 0
        for key in keys:
            if not self._touch(self._path(key, ValueKind.KV)):
                break
            n += 1
        return n

    def exists_states(self, keys: Sequence[bytes]) -> list[bool]:
        self._check_open()
        return [self._touch(self._path(k, ValueKind.STATE)) for k in keys]

    def get_pages(self, keys: Sequence[bytes], dest: Sequence[Buffer]) -> int:
        self._check_open()
        check_batch(keys, dest, "dest")
        n = 0
        for key, buf in zip(keys, dest):
            if not self._read(key, ValueKind.KV, buf):
                break
            n += 1
        return n

    def set_pages(self, keys: Sequence[bytes], blobs: Sequence[Buffer], token_count: int = 0) -> list[bool]:
        self._check_open()
        check_batch(keys, blobs, "blobs")
        return [self._write(k, ValueKind.KV, b, token_count) for k, b in zip(keys, blobs)]

    def get_state(self, key: bytes, dest: Buffer) -> bool:
        self._check_open()
        check_batch([key], [dest], "dest")
        return self._read(key, ValueKind.STATE, dest)

    def set_state(self, key: bytes, blob: Buffer) -> bool:
        self._check_open()
        check_batch([key], [blob], "blob")
        return self._write(key, ValueKind.STATE, blob, 0)

    def close(self) -> None:
        with self._lock:
            self._closed = True

    def stats(self) -> StorageStats:
        with self._lock:
            used = self._used
        return self.counters.snapshot(used_bytes=used, capacity_bytes=self.max_bytes)

    # ---- reads ---------------------------------------------------------------------------------

    def _read(self, key: bytes, kind: ValueKind, dest: Buffer) -> bool:
        out = memoryview(dest).cast("B")
        path = self._path(key, kind)
        try:
            f = open(path, "rb", buffering=0)  # noqa: SIM115 - closed below; opening apart tells a miss from a read
        except FileNotFoundError:
            self.counters.add(num_misses=1)
            return False
        except OSError as e:
            self._log_once(f"read:{e.errno}", f"cannot open stored values ({e}); treating as misses")
            self.counters.add(num_misses=1)
            return False
        with f:
            head = bytearray(HEADER_BYTES)
            why = None
            if _read_full(f, memoryview(head)) != HEADER_BYTES:
                why = "truncated header"
            else:
                why = self.codec.problem(head, kind, key, out.nbytes)
            if why is None:
                # Straight into the caller's buffer (a host-pool page): no intermediate copy.
                if _read_full(f, out) != out.nbytes:
                    why = "truncated payload"
                elif f.read(1):
                    why = "trailing bytes"
                elif not self.codec.checksum_ok(head, out):
                    why = "checksum mismatch"
        if why is not None:
            self._discard(path, why)
            return False
        self._touch(path)
        nbytes = HEADER_BYTES + out.nbytes
        if kind is ValueKind.KV:
            self.counters.add(num_read_pages=1, num_read_bytes=nbytes)
        else:
            self.counters.add(num_read_states=1, num_read_bytes=nbytes)
        return True

    def _discard(self, path: str, why: str) -> None:
        self.counters.add(num_corrupt=1)
        _log.warning("storage: %s is corrupt (%s); deleted, treated as a miss", path, why)
        try:
            size = os.stat(path).st_size
            os.unlink(path)
        except OSError:
            return  # already gone, or a read-only store: it stays a miss either way
        self._unreserve(size)

    # ---- writes --------------------------------------------------------------------------------

    def _write(self, key: bytes, kind: ValueKind, blob: Buffer, token_count: int) -> bool:
        path = self._path(key, kind)
        if self._touch(path):
            self.counters.add(num_skipped_writes=1)
            return True
        payload = memoryview(blob).cast("B")
        nbytes = HEADER_BYTES + payload.nbytes
        if not self._reserve(nbytes):
            self.counters.add(num_refused_writes=1)
            return False
        header = self.codec.header(kind, key, payload, token_count)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            fd = self._create(path, tmp)
            try:
                _write_full(fd, memoryview(header))
                _write_full(fd, payload)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            self._unreserve(nbytes)
            self.counters.add(num_refused_writes=1)
            self._log_once(f"write:{e.errno}", f"storage writes to {self.dir} fail ({e}); refusing them")
            return False
        if kind is ValueKind.KV:
            self.counters.add(num_written_pages=1, num_written_bytes=nbytes)
        else:
            self.counters.add(num_written_states=1, num_written_bytes=nbytes)
        return True

    # ---- recency and the size cap --------------------------------------------------------------

    def _touch(self, path: str) -> bool:
        """Refresh the file's recency; whether it exists."""
        try:
            os.utime(path)
            return True
        except FileNotFoundError:
            return False
        except OSError:
            return os.path.exists(path)  # read-only store: it still serves reads

    def _reserve(self, nbytes: int) -> bool:
        if not self.max_bytes:
            return True
        if nbytes > self.max_bytes:
            return False
        with self._lock:
            if self._used + nbytes <= self.max_bytes:
                self._used += nbytes
                return True
        if not self._evict_lock.acquire(blocking=False):
            return False  # another writer is evicting: refuse rather than wait
        try:
            self._scan_and_evict(int(self.max_bytes * self.low_watermark) - nbytes)
        finally:
            self._evict_lock.release()
        with self._lock:
            if self._used + nbytes <= self.max_bytes:
                self._used += nbytes
                return True
        return False

    def _unreserve(self, nbytes: int) -> None:
        if self.max_bytes:
            with self._lock:
                self._used = max(0, self._used - nbytes)

    def _scan_and_evict(self, target_bytes: int) -> None:
        """Re-count the directory, drop dead writers' temp files, and delete the least recently
        used values until at most `target_bytes` remain."""
        now = time.time()
        files: list[tuple[float, int, str]] = []
        try:
            subdirs = list(os.scandir(self.dir))
        except OSError:
            return
        for sub in subdirs:
            if not sub.is_dir(follow_symlinks=False):
                continue
            try:
                entries = list(os.scandir(sub.path))
            except OSError:
                continue
            for e in entries:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if e.name.endswith(".tmp"):
                    if now - st.st_mtime > _STALE_TMP_S:
                        _unlink_quietly(e.path)
                    continue
                files.append((st.st_mtime, st.st_size, e.path))
        total = sum(size for _, size, _ in files)
        evicted = 0
        if total > target_bytes:
            files.sort()
            for _, size, path in files:
                if total <= target_bytes:
                    break
                if _unlink_quietly(path):
                    total -= size
                    evicted += 1
        with self._lock:
            self._used = total
        if evicted:
            self.counters.add(num_evicted=evicted)

    # ---- misc ----------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"storage backend {self.dir} is closed")

    def _log_once(self, what: str, message: str) -> None:
        with self._lock:
            if what in self._logged:
                return
            self._logged.add(what)
        _log.warning("storage: %s", message)


def _read_full(f: io.FileIO, out: memoryview) -> int:
    got = 0
    while got < out.nbytes:
        n = f.readinto(out[got:])
        if not n:
            break
        got += n
    return got


def _write_full(fd: int, data: memoryview) -> None:
    done = 0
    while done < data.nbytes:
        done += os.write(fd, data[done:])


def _unlink_quietly(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False
