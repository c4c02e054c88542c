"""The `file` storage backend (the default, embedded): values packed into append-only segment files.

Layout: `<root>/<fingerprint hex>/<instance>-<n>.seg`. The fingerprint directory keeps models apart.
Each backend instance (a server: pid + random tag) appends only to segments of its own, so several
servers share one directory without locks, and every instance reads every segment. A segment is a
run of records `header || payload` (base.py: the header names the kind, key and payload length and
carries a CRC-32 over header and payload); a batch of pages is one `pwritev` (and one `fdatasync`
with `fsync`), so a write costs a few syscalls per batch instead of a file creation per page.
Segments roll over at `segment_bytes`.

Index: (kind, key) -> (segment, offset), in memory. Opening scans every segment's headers (not the
payloads); a scan stops at the first record that does not parse or runs past the end of the file
(the torn tail of a writer that died mid-append), which is thereby ignored. A record whose checksum
fails on read is a counted miss and leaves the index; the rest of its batch is then checked too, so
one backup can replace every bad value of a prefix. Reads keep a few descriptors open per thread
(a prefetch reads a segment batch after batch; reopening loses the kernel's readahead). Segments other servers append to are picked up
by a re-scan (at most every `rescan_s`) when a key misses. Files survive restarts: a new instance
on the same directory serves what earlier ones wrote.

Cap: `max_bytes` bounds the whole directory (every instance's segments). The instances sharing the
directory keep its byte count in one small file (`usage`, updated under `flock`), so each write is
checked against everyone's. A write that would exceed the cap re-counts the directory (correcting any
drift, e.g. from a server that died) and deletes whole segments, least recently used first, down to
`low_watermark` of the cap. Recency is a segment's mtime: appends refresh it, reads and `exists`
refresh it at most every `touch_interval_s`. A writer whose active segment another server deleted
notices (its link count is 0) and starts a new one. With no cap given, `open_backend` sets the
default: `DEFAULT_CAP_FRACTION` of the filesystem's free space at start.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Sequence
from enum import Enum
from pathlib import Path

from himamba.services.cache.storage.base import (
    HEADER_BYTES,
    Buffer,
    StorageBackend,
    StorageStats,
    ValueKind,
    check_batch,
)
from himamba.services.cache.storage.file_modes import storage_modes

__all__ = ["DEFAULT_CAP_FRACTION", "FileBackend", "default_cap", "default_storage_dir", "filesystem_free_bytes"]

_log = logging.getLogger("himamba.cache.storage")
_SEG = ".seg"
DEFAULT_CAP_FRACTION = 0.10  # of the filesystem's free space at start, when no cap is given
_MAX_SEGMENT_BYTES = 64 << 20


def default_storage_dir() -> Path:
    """`$XDG_CACHE_HOME/himamba/storage`, or `~/.cache/himamba/storage`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "himamba" / "storage"


def default_cap(free_bytes: int) -> int:
    """The file tier's cap when none is given: a fixed fraction of the free space at start."""
    return max(int(free_bytes * DEFAULT_CAP_FRACTION), 1)


def filesystem_free_bytes(directory: Path) -> int:
    """Free bytes (for unprivileged users) on the filesystem that holds, or will hold, `directory`."""
    d = Path(directory)
    while not d.exists() and d.parent != d:
        d = d.parent
    return shutil.disk_usage(d).free


class _Got(Enum):
    """How one read ended."""

    OK = 1
    MISS = 2
    CORRUPT = 3


class _Segment:
    """One segment file as this instance knows it."""

    __slots__ = ("gone", "keys", "mtime", "name", "own", "path", "scanned", "size", "touched")

    def __init__(self, name: str, path: str, own: bool) -> None:
        self.name = name
        self.path = path
        self.size = 0  # bytes on disk (as last seen)
        self.scanned = 0  # records before this offset are indexed
        self.mtime = 0.0
        self.touched = 0.0  # monotonic time of our last recency refresh
        self.keys: list[tuple[ValueKind, bytes]] = []
        self.own = own
        self.gone = False  # forgotten (deleted here or by another server): kept descriptors close


class FileBackend(StorageBackend):
    """Values in append-only segment files under `root/<fingerprint hex>/`; see the module docstring.

    `max_bytes` caps the directory (0: no cap here; `open_backend` applies the default); `fsync`
    makes each batch durable before it is acknowledged (off by default: a value lost in a crash is
    only a cache miss, and a torn one is caught by its checksum). What it creates is its user's
    alone (0600), or also readable by `group` (0640; file_modes.py); an unusable group is a ValueError."""

    name = "file"

    def __init__(
        self,
        fingerprint: bytes,
        root: Path | None = None,
        *,
        max_bytes: int = 0,
        fsync: bool = False,
        low_watermark: float = 0.9,
        segment_bytes: int = 0,
        rescan_s: float = 0.5,
        touch_interval_s: float = 1.0,
        group: str = "",
    ) -> None:
        super().__init__(fingerprint)
        self.modes = storage_modes(group)
        if max_bytes < 0:
            raise ValueError(f"max_bytes: must be >= 0, got {max_bytes}")
        if not 0.0 < low_watermark <= 1.0:
            raise ValueError(f"low_watermark: must be in (0, 1], got {low_watermark}")
        if segment_bytes < 0:
            raise ValueError(f"segment_bytes: must be >= 0, got {segment_bytes}")
        self.dir = Path(root if root is not None else default_storage_dir()) / fingerprint.hex()
        self.max_bytes = max_bytes
        self.fsync = fsync
        self.low_watermark = low_watermark
        # Whole segments are evicted: keep them a small part of the cap.
        self.segment_bytes = segment_bytes or (
            min(_MAX_SEGMENT_BYTES, max(max_bytes // 16, 1)) if max_bytes else _MAX_SEGMENT_BYTES
        )
        self.rescan_s = rescan_s
        self.touch_interval_s = touch_interval_s
        self._tag = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._lock = threading.RLock()  # index, segments, byte counts, logged, closed
        self._write_lock = threading.Lock()  # one append at a time (the disk is serial anyway)
        self._local = threading.local()  # per-thread scratch buffers
        self._fds = _ReadFds()
        self._index: dict[tuple[ValueKind, bytes], tuple[_Segment, int, int]] = {}
        self._segments: dict[str, _Segment] = {}
        self._active: _Segment | None = None
        self._active_fd: int | None = None
        self._seq = 0
        self._used = 0
        self._state_bytes = 0
        self._last_scan = 0.0
        self._logged: set[str] = set()
        self._closed = False
        self._usage_fd: int | None = None  # the directory's shared byte count (None: count alone)
        try:
            self.modes.make_dirs(self.dir)
        except OSError as e:
            self._log_once("mkdir", f"storage dir {self.dir} unusable, every write will be refused: {e}")
        self._rescan(force=True)
        if max_bytes:
            try:
                self._usage_fd = os.open(os.path.join(self.dir, "usage"), os.O_RDWR | os.O_CREAT, self.modes.file)
            except OSError:
                pass  # a read-only store writes nothing anyway
            else:
                if os.fstat(self._usage_fd).st_uid == os.geteuid():
                    self.modes.apply_fd(self._usage_fd)
                with self._lock, self._shared():
                    self._set_shared(self._used)  # a fresh count corrects what a dead server left

    # ---- the contract --------------------------------------------------------------------------

    def exists(self, keys: Sequence[bytes]) -> int:
        self._check_open()
        n = 0
        for key in keys:
            ent = self._find(ValueKind.KV, key)
            if ent is None:
                break
            self._touch(ent[0])
            n += 1
        return n

    def exists_states(self, keys: Sequence[bytes]) -> list[bool]:
        self._check_open()
        out = []
        for k in keys:
            ent = self._find(ValueKind.STATE, k)
            if ent is not None:
                self._touch(ent[0])
            out.append(ent is not None)
        return out

    def get_pages(self, keys: Sequence[bytes], dest: Sequence[Buffer]) -> int:
        self._check_open()
        check_batch(keys, dest, "dest")
        fds = self._fds
        fds.sweep()
        n = 0
        while n < len(keys):
            # Values written together lie back to back: read such a run in one call, straight
            # into the callers' buffers, then verify each; a run of one is the general case.
            run = self._run_at(keys, dest, n)
            if len(run) > 1 and self._read_run(run, keys, dest, n, fds):
                n += len(run)
                continue
            got = self._read(ValueKind.KV, keys[n], dest[n], fds)
            if got is _Got.CORRUPT:
                self._sweep(keys, dest, n + 1, fds)
            if got is not _Got.OK:
                break
            n += 1
        return n

    def _run_at(self, keys: Sequence[bytes], dest: Sequence[Buffer], start: int) -> list[tuple[_Segment, int, int]]:
        run: list[tuple[_Segment, int, int]] = []
        for i in range(start, len(keys)):
            ent = self._index.get((ValueKind.KV, keys[i]))
            if ent is None or ent[2] != memoryview(dest[i]).nbytes:
                break
            if run and (ent[0] is not run[0][0] or ent[1] != run[-1][1] + HEADER_BYTES + run[-1][2]):
                break
            run.append(ent)
            if len(run) == _IOV_MAX // 2:
                break  # one preadv at most (a header and a payload per value)
        return run

    def _read_run(
        self, run: list[tuple[_Segment, int, int]], keys: Sequence[bytes], dest: Sequence[Buffer], start: int,
        fds: _ReadFds,
    ) -> bool:
        """Read and verify a run of back-to-back values; False (nothing counted) if any is not
        whole and valid: the caller then reads them one by one, which tells misses and corruption."""
        seg = run[0][0]
        try:
            fd = fds.open(seg)
        except OSError:
            return False
        # The headers land in one scratch buffer of this thread's, the payloads in the callers' buffers.
        heads = self._scratch(len(run) * HEADER_BYTES)
        iov: list[Buffer] = []
        for i in range(len(run)):
            iov.append(heads[i * HEADER_BYTES : (i + 1) * HEADER_BYTES])
            iov.append(dest[start + i])
        total = run[-1][1] + HEADER_BYTES + run[-1][2] - run[0][1]
        try:
            if os.preadv(fd, iov, run[0][1]) != total:
                return False
        except OSError:
            return False
        verified = self.codec.verified
        for i in range(len(run)):
            if not verified(iov[2 * i], ValueKind.KV, keys[start + i], iov[2 * i + 1]):
                return False
        self._touch(seg)
        self.counters.add(num_read_pages=len(run), num_read_bytes=total)
        return True

    def _scratch(self, nbytes: int) -> memoryview:
        """A buffer of at least `nbytes` owned by the calling thread (no allocation per call)."""
        buf = getattr(self._local, "scratch", None)
        if buf is None or len(buf) < nbytes:
            buf = self._local.scratch = bytearray(max(nbytes, 64 * HEADER_BYTES))
        return memoryview(buf)

    def set_pages(self, keys: Sequence[bytes], blobs: Sequence[Buffer], token_count: int = 0) -> list[bool]:
        self._check_open()
        check_batch(keys, blobs, "blobs")
        return self._write(ValueKind.KV, keys, blobs, token_count)

    def get_state(self, key: bytes, dest: Buffer) -> bool:
        self._check_open()
        check_batch([key], [dest], "dest")
        self._fds.sweep()
        return self._read(ValueKind.STATE, key, dest, self._fds) is _Got.OK

    def set_state(self, key: bytes, blob: Buffer) -> bool:
        self._check_open()
        check_batch([key], [blob], "blob")
        return self._write(ValueKind.STATE, [key], [blob], 0)[0]

    def close(self) -> None:
        with self._write_lock, self._lock:
            self._closed = True
            self._close_active()
            self._fds.close_all()
            if self._usage_fd is not None:
                os.close(self._usage_fd)
                self._usage_fd = None

    def stats(self) -> StorageStats:
        with self._lock:
            used, state = self._used, self._state_bytes
        return self.counters.snapshot(used_bytes=used, used_state_bytes=state, capacity_bytes=self.max_bytes)

    # ---- the index -----------------------------------------------------------------------------

    def _find(self, kind: ValueKind, key: bytes) -> tuple[_Segment, int, int] | None:
        ent = self._index.get((kind, key))
        if ent is None and self._rescan():
            ent = self._index.get((kind, key))  # another server may have written it meanwhile
        return ent

    def _add(self, seg: _Segment, kind: ValueKind, key: bytes, offset: int, nbytes: int) -> None:
        if (kind, key) in self._index:
            return  # the first copy serves; this one is dead weight until its segment goes
        self._index[(kind, key)] = (seg, offset, nbytes)
        seg.keys.append((kind, key))
        if kind is ValueKind.STATE:
            self._state_bytes += HEADER_BYTES + nbytes

    def _forget(self, seg: _Segment) -> None:
        """Drop a segment that is gone (evicted here or by another server)."""
        self._segments.pop(seg.name, None)
        seg.gone = True
        for k in seg.keys:
            ent = self._index.get(k)
            if ent is not None and ent[0] is seg:
                del self._index[k]
                if k[0] is ValueKind.STATE:
                    self._state_bytes -= HEADER_BYTES + ent[2]
        seg.keys = []

    def _rescan(self, force: bool = False) -> bool:
        """Re-list the directory: index what other servers appended, forget what vanished, and
        re-count the directory's bytes. Throttled to once per `rescan_s` unless forced; whether it
        ran."""
        now = time.monotonic()
        with self._lock:
            if not force and now - self._last_scan < self.rescan_s:
                return False
            self._last_scan = now
            try:
                entries = [e for e in os.scandir(self.dir) if e.name.endswith(_SEG)]
            except OSError:
                entries = []
            seen: set[str] = set()
            used = 0
            for e in entries:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                seen.add(e.name)
                used += st.st_size
                seg = self._segments.get(e.name)
                if seg is None:
                    seg = self._segments[e.name] = _Segment(e.name, e.path, own=False)
                seg.mtime = st.st_mtime
                if not seg.own:
                    seg.size = st.st_size
                    if seg.scanned < seg.size:
                        self._scan(seg)
            for name in [n for n in self._segments if n not in seen]:
                seg = self._segments[name]
                if seg is self._active:
                    continue  # just created, or deleted under us: the writer notices
                self._forget(seg)
            self._used = used
            return True

    def _scan(self, seg: _Segment) -> None:
        """Index the records of `seg` from `seg.scanned` on, up to the first one that does not
        parse or is not wholly on disk yet (a torn tail, or an append in progress)."""
        try:
            fd = os.open(seg.path, os.O_RDONLY)
        except OSError:
            return
        try:
            off = seg.scanned
            head = bytearray(HEADER_BYTES)
            while off + HEADER_BYTES <= seg.size:
                if os.preadv(fd, [head], off) != HEADER_BYTES:
                    break
                d = self.codec.describe(head)
                if d is None or off + HEADER_BYTES + d[2] > seg.size:
                    break
                self._add(seg, d[0], d[1], off, d[2])
                off += HEADER_BYTES + d[2]
            seg.scanned = off
        except OSError:
            pass
        finally:
            os.close(fd)

    def _touch(self, seg: _Segment) -> None:
        now = time.monotonic()
        if now - seg.touched < self.touch_interval_s:
            return
        seg.touched = now
        try:
            os.utime(seg.path)
            seg.mtime = time.time()
        except OSError:
            pass  # gone, or a read-only store: recency is best effort

    # ---- reads ---------------------------------------------------------------------------------


    def _sweep(self, keys: Sequence[bytes], dest: Sequence[Buffer], start: int, fds: _ReadFds) -> None:
        """After a corrupt value: check the rest of the batch too (read into the callers' buffers,
        whose bytes past the answer are unspecified anyway) and forget every corrupt one, so a
        single backup can replace them all (a corruption rarely hits one value alone). Values
        that verify are not counted as read: the caller does not get them."""
        for i in range(start, len(keys)):
            ent = self._index.get((ValueKind.KV, keys[i]))
            if ent is not None:
                self._read(ValueKind.KV, keys[i], dest[i], fds, count=False)

    def _read(self, kind: ValueKind, key: bytes, dest: Buffer, fds: _ReadFds, count: bool = True) -> _Got:
        out = memoryview(dest).cast("B")
        ent = self._find(kind, key)
        if ent is None:
            self.counters.add(num_misses=1)
            return _Got.MISS
        seg, off, nbytes = ent
        try:
            fd = fds.open(seg)
        except FileNotFoundError:
            with self._lock:
                self._forget(seg)  # evicted (here or by another server)
            self.counters.add(num_misses=1)
            return _Got.MISS
        except OSError as e:
            self._log_once(f"read:{e.errno}", f"cannot open stored values ({e}); treating as misses")
            self.counters.add(num_misses=1)
            return _Got.MISS
        head = bytearray(HEADER_BYTES)
        why = None
        if nbytes != out.nbytes:
            why = f"payload of {nbytes} bytes, expected {out.nbytes}"
        else:
            # Header and payload in one call, the payload straight into the caller's buffer.
            try:
                got = os.preadv(fd, [head, out], off)
            except OSError as e:
                got, why = 0, f"read error: {e}"
            if why is None and got != HEADER_BYTES + nbytes:
                why = "truncated value"
            if why is None:
                why = self.codec.problem(head, kind, key, out.nbytes)
            if why is None and not self.codec.checksum_ok(head, out):
                why = "checksum mismatch"
        if why is not None:
            self._corrupt(seg, kind, key, off, why)
            return _Got.CORRUPT
        self._touch(seg)
        if not count:
            pass
        elif kind is ValueKind.KV:
            self.counters.add(num_read_pages=1, num_read_bytes=HEADER_BYTES + nbytes)
        else:
            self.counters.add(num_read_states=1, num_read_bytes=HEADER_BYTES + nbytes)
        return _Got.OK

    def _corrupt(self, seg: _Segment, kind: ValueKind, key: bytes, off: int, why: str) -> None:
        self.counters.add(num_corrupt=1)
        _log.warning("storage: the value at %s:%d is corrupt (%s); forgotten, treated as a miss", seg.path, off, why)
        with self._lock:
            ent = self._index.get((kind, key))
            if ent is not None and ent[0] is seg and ent[1] == off:
                del self._index[(kind, key)]
                if kind is ValueKind.STATE:
                    self._state_bytes -= HEADER_BYTES + ent[2]

    # ---- writes --------------------------------------------------------------------------------

    def _write(self, kind: ValueKind, keys: Sequence[bytes], blobs: Sequence[Buffer], token_count: int) -> list[bool]:
        out = [False] * len(keys)
        todo: list[int] = []
        batch: set[bytes] = set()
        alive: dict[str, bool] = {}  # a value is skipped only if its segment is still on disk
        for i, key in enumerate(keys):
            ent = self._index.get((kind, key))
            if ent is not None and ent[0].name not in alive:
                alive[ent[0].name] = os.path.exists(ent[0].path)
                if not alive[ent[0].name]:
                    with self._lock:
                        self._forget(ent[0])  # deleted by another server (or by hand)
            if ent is not None and alive[ent[0].name]:
                self._touch(ent[0])
                self.counters.add(num_skipped_writes=1)
                out[i] = True
            elif key not in batch:
                batch.add(key)
                todo.append(i)
        if not todo:
            return out
        iov: list[Buffer] = []
        sizes: list[int] = []
        heads = self._scratch(len(todo) * HEADER_BYTES)  # used only until the write returns
        header_into = self.codec.header_into
        for n, i in enumerate(todo):
            payload = memoryview(blobs[i]).cast("B")
            head = heads[n * HEADER_BYTES : (n + 1) * HEADER_BYTES]
            header_into(head, kind, keys[i], payload, token_count)
            iov += [head, payload]
            sizes.append(payload.nbytes)
        total = sum(sizes) + HEADER_BYTES * len(todo)
        ok = self._append(iov, total, [(kind, keys[i], n) for i, n in zip(todo, sizes)])
        for i in todo:
            out[i] = ok
        for i, key in enumerate(keys):  # a key repeated within the batch was stored with its first copy
            if not out[i] and key in batch and ok:
                out[i] = True
        if ok:
            written = {"num_written_pages" if kind is ValueKind.KV else "num_written_states": len(todo)}
            self.counters.add(num_written_bytes=total, **written)
        else:
            self.counters.add(num_refused_writes=len(todo))
        return out

    def _append(self, iov: list[Buffer], total: int, records: list[tuple[ValueKind, bytes, int]]) -> bool:
        with self._write_lock:
            if self._closed:
                return False
            if not self._reserve(total):
                return False
            try:
                seg, fd = self._segment_for(total)
                start = seg.size
                _pwritev_all(fd, iov, start, total)
                if self.fsync:
                    os.fdatasync(fd)
            except OSError as e:
                with self._lock:
                    self._unreserve(total)
                    self._close_active()  # its tail may be torn: the next write starts a new segment
                self._log_once(f"write:{e.errno}", f"storage writes to {self.dir} fail ({e}); refusing them")
                return False
            with self._lock:
                off = start
                for kind, key, nbytes in records:
                    self._add(seg, kind, key, off, nbytes)
                    off += HEADER_BYTES + nbytes
                seg.size = seg.scanned = off
                seg.mtime = time.time()
                seg.touched = time.monotonic()
            return True

    def _segment_for(self, nbytes: int) -> tuple[_Segment, int]:
        """The active segment (a new one when it is full, or another server deleted it)."""
        seg, fd = self._active, self._active_fd
        if seg is not None and fd is not None:
            full = seg.size and seg.size + nbytes > self.segment_bytes
            if full or os.fstat(fd).st_nlink == 0:
                with self._lock:
                    if not full:
                        self._forget(seg)
                    self._close_active()
                seg = None
        if seg is None or self._active_fd is None:
            self._seq += 1
            name = f"{self._tag}-{self._seq:06d}{_SEG}"
            path = os.path.join(self.dir, name)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, self.modes.file)
            except FileNotFoundError:
                self.modes.make_dirs(self.dir)  # the directory was removed under us
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, self.modes.file)
            try:
                self.modes.apply_fd(fd)
            except OSError:
                os.close(fd)
                os.unlink(path)
                raise
            seg = _Segment(name, path, own=True)
            with self._lock:
                self._segments[name] = seg
                self._active, self._active_fd = seg, fd
        assert self._active_fd is not None
        return seg, self._active_fd

    def _close_active(self) -> None:
        if self._active_fd is not None:
            try:
                os.close(self._active_fd)
            except OSError:
                pass
        self._active, self._active_fd = None, None

    # ---- the size cap --------------------------------------------------------------------------

    def _reserve(self, nbytes: int) -> bool:
        """Room for `nbytes` under the cap, evicting least recently used segments if needed."""
        with self._lock:
            if not self.max_bytes:
                self._used += nbytes
                return True
            if nbytes > self.max_bytes:
                return False
            with self._shared():
                used = self._get_shared()
                if used + nbytes > self.max_bytes:
                    self._rescan(force=True)  # the true count: other servers' writes and evictions
                    if self._used + nbytes > self.max_bytes:
                        self._evict(int(self.max_bytes * self.low_watermark) - nbytes)
                    used = self._used
                if used + nbytes > self.max_bytes:
                    self._set_shared(used)
                    return False
                self._set_shared(used + nbytes)
                self._used = used + nbytes
                return True

    def _unreserve(self, nbytes: int) -> None:
        with self._lock, self._shared():
            self._used = max(0, self._get_shared() - nbytes)
            self._set_shared(self._used)

    def _shared(self) -> _Flock:
        return _Flock(self._usage_fd)

    def _get_shared(self) -> int:
        if self._usage_fd is None:
            return self._used
        raw = os.pread(self._usage_fd, 8, 0)
        return int.from_bytes(raw, "little") if len(raw) == 8 else self._used

    def _set_shared(self, value: int) -> None:
        if self._usage_fd is not None:
            os.pwrite(self._usage_fd, max(value, 0).to_bytes(8, "little"), 0)

    def _evict(self, target_bytes: int) -> None:
        """Delete whole segments, least recently used first, until the directory holds at most
        `target_bytes` (called with the lock held, after a rescan)."""
        evicted = 0
        for seg in sorted(self._segments.values(), key=lambda s: s.mtime):
            if self._used <= target_bytes:
                break
            size = seg.size
            try:
                os.unlink(seg.path)
            except FileNotFoundError:
                pass
            except OSError:
                continue  # a read-only store: nothing can go
            if seg is self._active:
                self._close_active()
            evicted += len(seg.keys)
            self._forget(seg)
            self._used -= size
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


_KEPT_FDS = 4  # read descriptors kept open per thread


class _ReadFds:
    """Read descriptors kept open across calls, a few per thread: a prefetch reads one segment
    batch after batch, and a descriptor reopened for every call loses the kernel's readahead state
    (measured: ~30% more CPU and slower cold reads than one kept open). A descriptor of a segment
    that is gone is closed at its thread's next read (so it does not hold a deleted file's space for
    long); the backend's close closes every one."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: set[int] = set()  # every descriptor kept, by any thread
        self._closed = False

    def _kept(self) -> dict[str, tuple[_Segment, int]]:
        kept = getattr(self._local, "kept", None)
        if kept is None:
            kept = self._local.kept = {}
        return kept

    def open(self, seg: _Segment) -> int:
        """A descriptor reading `seg` (OSError as os.open raises it)."""
        kept = self._kept()
        ent = kept.get(seg.name)
        if ent is not None:
            if ent[0] is seg and not seg.gone:
                return ent[1]
            self._drop(kept, seg.name)
        fd = os.open(seg.path, os.O_RDONLY)
        with self._lock:
            if self._closed:
                os.close(fd)
                raise OSError(errno.EBADF, "the storage backend is closed")
            self._open.add(fd)
        kept[seg.name] = (seg, fd)
        if len(kept) > _KEPT_FDS:
            self._drop(kept, next(iter(kept)))
        return fd

    def sweep(self) -> None:
        """Close this thread's descriptors of segments that are gone."""
        kept = self._kept()
        for name in [n for n, (seg, _) in kept.items() if seg.gone]:
            self._drop(kept, name)

    def _drop(self, kept: dict[str, tuple[_Segment, int]], name: str) -> None:
        _seg, fd = kept.pop(name)
        with self._lock:
            if fd not in self._open:
                return  # closed by close_all (the number may belong to someone else now)
            self._open.discard(fd)
        os.close(fd)

    def close_all(self) -> None:
        with self._lock:
            self._closed = True
            fds, self._open = self._open, set()
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


class _Flock:
    """An exclusive flock on the directory's usage file for a `with` block (nothing without one)."""

    def __init__(self, fd: int | None) -> None:
        self.fd = fd

    def __enter__(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)


_IOV_MAX = 1024  # Linux's limit on buffers per pwritev


def _pwritev_all(fd: int, iov: list[Buffer], offset: int, total: int) -> None:
    if len(iov) > _IOV_MAX:
        for i in range(0, len(iov), _IOV_MAX):
            part = iov[i : i + _IOV_MAX]
            nbytes = sum(memoryview(b).nbytes for b in part)
            _pwritev_all(fd, part, offset, nbytes)
            offset += nbytes
        return
    done = os.pwritev(fd, iov, offset)
    if done == total:
        return
    rest = b"".join(bytes(b) for b in iov)[done:]  # a short write (rare): finish with plain writes
    while rest:
        n = os.pwrite(fd, rest, offset + done)
        done += n
        rest = rest[n:]
