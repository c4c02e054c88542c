"""Stored responses on the fleet's shared storage tier, so any server behind a router finds them.

Who owns them: the front door. A stored response (its Response object, input items and the token
ids its turn ran on) is the front door's state, made, read, deleted and bounded by it; it is not
KV: the cache service's storage tier stores pages under page keys with a checksummed header, a
model fingerprint and a budget of its own, and none of that fits a record looked up by id. So the
front door does not ask the cache service to store it (a message round trip through a process
that would then own records it never reads), and does not import the cache service: it opens its
own small client of the same shared backend the operator configured for the storage tier
(`--hicache-storage-backend`), in a namespace of its own. The module lives with the front door,
not in common/, because no other service reads or writes these records.

- file: one file per response under `<--hicache-storage-dir>/responses/` (`<id>.rec`, written to a
  temporary name and renamed, so a reader never sees half of one; 0600, or 0640 for
  `--hicache-storage-group`). Servers sharing the directory (one host, or a shared filesystem)
  share the records. The cache's segments live in `<dir>/<model fingerprint>/` and never see them.
  Recency is a record's mtime, set in nanoseconds; each write scans the directory to keep the
  bounds (measured: 1-3.5 ms a write with 0-600 records of 30 KB).
- redis: the string `himamba:responses:<id>`, with a sorted set (recency) and a hash (sizes) that a
  Lua script keeps with it, so bounding is atomic across the servers sharing that Redis. A Redis
  run with `allkeys-lru` (as the KV tier suggests) may evict records before the bounds do.
- mooncake: not used (its store is a KV-page transport); responses stay in each server's memory.

Bounds: the same `--responses-store-max` (count) and `--responses-store-mib` (bytes) as the memory
store, over the whole shared namespace, least recently used dropped first (a read refreshes a
record). Failures: a write that fails does not fail the response (it stays in this server's
memory: counted in `himamba_responses_shared_store_errors_total{store_op="write"}` and logged); a
read that fails is `SharedStoreError`, which the routes answer with 503 (the record may well
exist: "not found" would be a lie a client does not retry). Every call runs in a small thread
pool with a timeout, so a hung store delays one request, never the event loop; a Redis that cannot
be reached fails the calls of the next `AWAY_S` at once (each would wait for a connect timeout).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import grp
import logging
import os
import secrets
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from himamba.common.config import Config

TIMEOUT_S = 5.0  # one store call, at most
AWAY_S = 2.0  # after Redis could not be reached, calls fail at once for this long
_REDIS_PREFIX = "himamba:responses:"
_SUFFIX = ".rec"


class SharedStoreError(Exception):
    """The shared store could not serve a call (unreachable, I/O error, timeout)."""


class SharedRecords(ABC):
    """Records (bytes) by response id; ids are checked by the caller (`response_ids.parse_id`).
    Every method may raise `SharedStoreError`."""

    where: str  # for messages: the directory or URL

    @abstractmethod
    def put(self, response_id: str, record: bytes) -> bool:
        """Store it, dropping the least recently used beyond the bounds; False: larger than them."""

    @abstractmethod
    def get(self, response_id: str) -> bytes | None:
        """The record (now the most recently used), or None when there is none."""

    @abstractmethod
    def delete(self, response_id: str) -> bool:
        """Remove it; False when there was none."""


class FileRecords(SharedRecords):
    """One file per record in a directory several servers may share (see the module docstring)."""

    def __init__(self, directory: Path, max_count: int, max_bytes: int, group: str = ""):
        self.dir = directory
        self.where = str(directory)
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._gid = -1 if not group else (int(group) if group.isdigit() else grp.getgrnam(group).gr_gid)
        self._file_mode, self._dir_mode = (0o600, 0o700) if self._gid < 0 else (0o640, 0o750)

    def _path(self, response_id: str) -> Path:
        return self.dir / f"{response_id}{_SUFFIX}"

    def put(self, response_id: str, record: bytes) -> bool:
        if len(record) > self.max_bytes or self.max_count == 0:
            return False
        try:
            if not self.dir.is_dir():
                self._make_dirs()
            tmp = self.dir / f".{response_id}.{secrets.token_hex(4)}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, self._file_mode)
            try:
                try:
                    if self._gid >= 0:
                        os.fchown(fd, -1, self._gid)
                    os.fchmod(fd, self._file_mode)  # whatever the umask
                    view = memoryview(record)
                    while view:
                        view = view[os.write(fd, view) :]
                finally:
                    os.close(fd)
                os.replace(tmp, self._path(response_id))
            except OSError:
                tmp.unlink(missing_ok=True)  # the bounds count records only: a left temporary would stay
                raise
            _touch(self._path(response_id))
            self._prune(self._path(response_id))
        except OSError as e:
            raise SharedStoreError(f"{self.where}: {e.strerror or e}") from e
        return True

    def _make_dirs(self) -> None:
        """mkdir -p, each directory made here given the directory mode and group whatever the umask
        (mkdir's parents=True would leave the parents at 0777 less the umask); one that another
        process made first keeps its own. The cache's file backend makes its directories the same
        way (cache/storage/file_modes.py; a service package does not import another's)."""
        missing = []
        d = self.dir
        while not d.exists() and d.parent != d:
            missing.append(d)
            d = d.parent
        for d in reversed(missing):
            try:
                d.mkdir(mode=self._dir_mode)
            except FileExistsError:  # another server made it first
                continue
            if self._gid >= 0:
                os.chown(d, -1, self._gid)
            os.chmod(d, self._dir_mode)

    def get(self, response_id: str) -> bytes | None:
        path = self._path(response_id)
        try:
            data = path.read_bytes()
            _touch(path)
        except FileNotFoundError:
            return None  # never stored, dropped by the bounds, or deleted (between read and utime too)
        except OSError as e:
            raise SharedStoreError(f"{self.where}: {e.strerror or e}") from e
        return data

    def delete(self, response_id: str) -> bool:
        try:
            self._path(response_id).unlink()
        except FileNotFoundError:
            return False
        except OSError as e:
            raise SharedStoreError(f"{self.where}: {e.strerror or e}") from e
        return True

    def _prune(self, written: Path) -> None:
        """Drop the least recently used records beyond the bounds (other servers' too: the bounds
        are the directory's), never the one just `written` (mtimes are coarse: it may tie)."""
        kept: list[tuple[int, int, str]] = []
        total = written.stat().st_size
        with os.scandir(self.dir) as entries:
            for entry in entries:
                if entry.name.endswith(_SUFFIX) and entry.name != written.name:
                    try:
                        st = entry.stat()
                    except FileNotFoundError:
                        continue
                    kept.append((st.st_mtime_ns, st.st_size, entry.path))
        total += sum(size for _, size, _ in kept)
        kept.sort()
        for _, size, path in kept:
            if len(kept) + 1 <= self.max_count and total <= self.max_bytes:
                break
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass  # another server dropped it first
            kept = kept[1:]
            total -= size


def _touch(path: Path) -> None:
    """A record's recency, for the bounds: its mtime, set to the clock's nanoseconds (the kernel's
    own file times are coarse, so records written in one burst would tie)."""
    now = time.time_ns()
    os.utime(path, ns=(now, now))


# Atomic put and bound: KEYS recency zset, sizes hash, total bytes; ARGV id, record, now, max count,
# max bytes, key prefix.
_PUT = """
local old = redis.call('HGET', KEYS[2], ARGV[1])
if old then redis.call('DECRBY', KEYS[3], old) end
redis.call('SET', ARGV[6] .. ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], string.len(ARGV[2]))
local total = redis.call('INCRBY', KEYS[3], string.len(ARGV[2]))
while redis.call('ZCARD', KEYS[1]) > tonumber(ARGV[4]) or total > tonumber(ARGV[5]) do
  local oldest = redis.call('ZPOPMIN', KEYS[1])
  if #oldest == 0 then break end
  local size = redis.call('HGET', KEYS[2], oldest[1])
  if size then
    total = redis.call('DECRBY', KEYS[3], size)
    redis.call('HDEL', KEYS[2], oldest[1])
  end
  redis.call('DEL', ARGV[6] .. oldest[1])
end
return 1
"""
# KEYS as _PUT's; ARGV id, key prefix. 1: it was there.
_DELETE = """
local size = redis.call('HGET', KEYS[2], ARGV[1])
if size then
  redis.call('DECRBY', KEYS[3], size)
  redis.call('HDEL', KEYS[2], ARGV[1])
end
redis.call('ZREM', KEYS[1], ARGV[1])
return redis.call('DEL', ARGV[2] .. ARGV[1])
"""


class RedisRecords(SharedRecords):
    """Records in a Redis server every server of the fleet points at (see the module docstring)."""

    def __init__(self, url: str, max_count: int, max_bytes: int, prefix: str = _REDIS_PREFIX):
        import redis  # only when chosen: a server without the redis tier needs no redis-py

        self.where = _without_secrets(url)  # for logs: never the password
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._prefix = prefix
        self._meta = [prefix + "@recency", prefix + "@sizes", prefix + "@bytes"]
        self._errors = (redis.RedisError, OSError)
        self._unreachable = (redis.ConnectionError, redis.TimeoutError, OSError)
        # A store that is away fails calls at once until then, instead of each waiting for a connect
        # timeout (every stored response would); the next call after it tries again.
        self._away_until = 0.0
        self._r = redis.Redis.from_url(url, socket_connect_timeout=1.0, socket_timeout=TIMEOUT_S)
        self._put = self._r.register_script(_PUT)
        self._delete = self._r.register_script(_DELETE)

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if time.monotonic() < self._away_until:
            raise SharedStoreError(f"{self.where}: unreachable (tried again in at most {AWAY_S:g} s)")
        try:
            return fn(*args, **kwargs)
        except self._errors as e:
            if isinstance(e, self._unreachable):
                self._away_until = time.monotonic() + AWAY_S
            raise SharedStoreError(f"{self.where}: {e}") from e

    def put(self, response_id: str, record: bytes) -> bool:
        if len(record) > self.max_bytes or self.max_count == 0:
            return False
        args = [response_id, record, time.time(), self.max_count, self.max_bytes, self._prefix]
        self._call(self._put, keys=self._meta, args=args)
        return True

    def get(self, response_id: str) -> bytes | None:
        data = self._call(self._r.get, self._prefix + response_id)
        if data is not None:
            self._call(self._r.zadd, self._meta[0], {response_id: time.time()}, xx=True)
        return data

    def delete(self, response_id: str) -> bool:
        return bool(self._call(self._delete, keys=self._meta, args=[response_id, self._prefix]))


def _without_secrets(url: str) -> str:
    """A store URL without its user and password (redis://:secret@host:6379/0 -> redis://host:6379/0)."""
    try:
        parts = urlsplit(url)
        host = f"{parts.hostname or ''}{'' if parts.port is None else f':{parts.port}'}"
    except ValueError:
        return "<the redis URL>"
    return f"{parts.scheme}://{host}{parts.path}"


def default_storage_dir() -> Path:
    """The cache's file tier's default directory (services/cache/storage/file.py says the same;
    a test holds them equal): `$XDG_CACHE_HOME/himamba/storage`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "himamba" / "storage"


def open_records(cfg: Config, log: logging.Logger) -> SharedRecords | None:
    """The shared records of this server's configured storage tier, or None (memory only)."""
    cache, http = cfg.cache, cfg.http
    backend = cache.hicache_storage_backend
    if backend == "none" or not http.responses_shared or http.responses_store_max == 0:
        return None
    max_bytes = http.responses_store_mib << 20
    try:
        if backend == "file":
            root = Path(cache.hicache_storage_dir) if cache.hicache_storage_dir else default_storage_dir()
            return FileRecords(root / "responses", http.responses_store_max, max_bytes, cache.hicache_storage_group)
        if backend == "redis":
            url = cache.hicache_storage_url or "redis://127.0.0.1:6379/0"
            return RedisRecords(url, http.responses_store_max, max_bytes)
    except (ImportError, KeyError, ValueError) as e:  # no redis-py, an unknown group, a bad URL
        log.warning("stored responses stay in this server's memory: the %s tier cannot hold them (%s)", backend, e)
        return None
    log.warning(
        "stored responses stay in this server's memory: the %s tier does not hold them; route a fleet by "
        "previous_response_id (docs/operations/fleet.md)", backend,
    )  # fmt: skip
    return None


class SharedResponses:
    """The shared records seen from the event loop: each call in a thread, with a timeout."""

    def __init__(self, records: SharedRecords):
        self.records = records
        self.where = records.where
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="shared-responses")

    async def _run(self, fn: Any, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(self._pool, fn, *args), TIMEOUT_S)
        except TimeoutError:
            raise SharedStoreError(f"{self.where}: no answer in {TIMEOUT_S:g} s") from None

    async def put(self, response_id: str, record: bytes) -> bool:
        return bool(await self._run(self.records.put, response_id, record))

    async def get(self, response_id: str) -> bytes | None:
        return await self._run(self.records.get, response_id)

    async def delete(self, response_id: str) -> bool:
        return bool(await self._run(self.records.delete, response_id))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
