"""The `redis` storage backend: pages and states as Redis strings, shared by every server that
points at the same Redis.

Keys are `<prefix><page key hex>:kv` and `...:st`; the page key is already salted with the model
fingerprint, so models never share entries, and the header (format version, fingerprint, token
count, CRC-32) is verified on every read: a value written by anything else is a miss (counted as
corrupt, and deleted so that a good copy can replace it).

Every batch is one round trip: a pipeline of EXISTS, one MGET, or a pipeline of `SET ... NX`
(NX: a value already stored, by us or by another server, is left as it is and counts as stored;
its bytes still travel, which an EXISTS round trip first would save only when most pages of a
backup are already there). Run Redis with `maxmemory` and `maxmemory-policy allkeys-lru` so it evicts on its own;
an acknowledged value may then vanish, which the contract allows. With `noeviction`, a full Redis
answers OOM: those writes are refused and counted (`num_refused_writes`).

When Redis goes away, a call fails after a short connect timeout (a connection error is retried
once, which also replaces a pooled connection left stale by a server restart), the backend answers
misses / refused writes, counts `num_errors`, and fails fast until a probe after a backoff finds
Redis back (reconnect.py). Nothing has to be restarted.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from himamba.services.cache.storage.base import (
    Buffer,
    ValueKind,
    check_batch,
)
from himamba.services.cache.storage.reconnect import ReconnectGate, StoreLink
from himamba.services.cache.storage.remote import RemoteBackend

__all__ = ["DEFAULT_REDIS_URL", "RedisBackend"]

_log = logging.getLogger("himamba.cache.storage")
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
_SUFFIX = {ValueKind.KV: b":kv", ValueKind.STATE: b":st"}
_SCHEMES = ("redis", "rediss", "unix")
# Failures that mean "Redis is not there" (OSError: a socket error redis-py did not wrap).
_UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, OSError)
_T = TypeVar("_T")


class _Unserved(Exception):
    """Internal: the store did not serve this call (already counted)."""


class RedisBackend(RemoteBackend):
    """Values in a Redis server at `url` (`redis://host:port/db`, `rediss://...`, `unix://path`);
    see the module docstring. `key_prefix` namespaces a deployment within one Redis database.
    `connect_timeout_s` bounds how long a call waits for an absent server; `op_timeout_s` bounds a
    whole batch (it must cover moving `batch * page bytes`). The backoff between probes of an
    absent server doubles from `backoff_base_s` to `backoff_max_s`."""

    name = "redis"

    def __init__(
        self,
        fingerprint: bytes,
        url: str = DEFAULT_REDIS_URL,
        *,
        key_prefix: str = "himamba:",
        connect_timeout_s: float = 1.0,
        op_timeout_s: float = 10.0,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 30.0,
    ) -> None:
        super().__init__(fingerprint)
        parts = urlsplit(url)
        if parts.scheme not in _SCHEMES:
            raise ValueError(
                f"hicache_storage_url: a Redis URL is redis://host:port/db (or rediss://, unix://), got {url!r}"
            )
        if connect_timeout_s <= 0 or op_timeout_s <= 0:
            raise ValueError(f"connect_timeout_s, op_timeout_s: must be > 0, got {connect_timeout_s}, {op_timeout_s}")
        self.url = url
        self.key_prefix = key_prefix.encode()
        # One retry, without waiting, of a connection error only: the first command on a pooled
        # connection that a server restart killed fails, and the retry reconnects. Retrying a
        # timeout (a hung server) or retrying more only makes an outage slower to detect.
        self._redis = redis.Redis.from_url(
            url,
            socket_connect_timeout=connect_timeout_s,
            socket_timeout=op_timeout_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
            health_check_interval=0,
        )
        where = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()  # never log a password
        self.link = StoreLink(f"redis at {where}", self.counters, ReconnectGate(backoff_base_s, backoff_max_s))
        self._lock = threading.Lock()
        self._closed = False

    # ---- the contract --------------------------------------------------------------------------

    def get_pages(self, keys: Sequence[bytes], dest: Sequence[Buffer]) -> int:
        self._check_open()
        check_batch(keys, dest, "dest")
        if not keys:
            return 0
        names = [self._name(k, ValueKind.KV) for k in keys]
        try:
            values = self._call(lambda: self._redis.mget(names))
        except _Unserved:
            return 0
        n = 0
        for key, name, value, buf in zip(keys, names, values, dest):
            if not self._accept(key, name, value, ValueKind.KV, buf):
                break
            n += 1
        if n < len(keys) and values[n] is not None:
            # A corrupt value: the rest of the batch came in the same reply, so check it too and
            # delete every bad one now, so good copies can replace them all in one backup (a
            # corruption usually hits more than one value).
            page_bytes = memoryview(dest[n]).nbytes
            bad = [
                name
                for key, name, value in zip(keys[n + 1 :], names[n + 1 :], values[n + 1 :])
                if value is not None and self.codec.check(value, ValueKind.KV, key, page_bytes) is not None
            ]
            if bad:
                self.counters.add(num_corrupt=len(bad))
                _log.warning("storage: %s holds %d more bad values in the batch; deleted", self.link.what, len(bad))
                try:
                    self._call(lambda: self._redis.delete(*bad))
                except _Unserved:
                    pass
        return n

    def get_state(self, key: bytes, dest: Buffer) -> bool:
        self._check_open()
        check_batch([key], [dest], "dest")
        name = self._name(key, ValueKind.STATE)
        try:
            value = self._call(lambda: self._redis.get(name))
        except _Unserved:
            return False
        return self._accept(key, name, value, ValueKind.STATE, dest)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._redis.close()

    # ---- helpers -------------------------------------------------------------------------------

    def _name(self, key: bytes, kind: ValueKind) -> bytes:
        return self.key_prefix + key.hex().encode() + _SUFFIX[kind]

    def _call(self, fn: Callable[[], _T]) -> _T:
        """Run `fn` (one Redis round trip) through the reconnect gate; raise _Unserved (counted)
        when the store did not serve it."""
        if not self.link.admit():
            raise _Unserved
        try:
            out = fn()
        except _UNREACHABLE as e:
            self.link.lost(f"{type(e).__name__}: {e}")
            raise _Unserved from e
        except redis.RedisError as e:
            # Redis answered, with an error for the whole call (e.g. NOAUTH, a wrong database).
            self.link.reached()
            self.counters.add(num_errors=1)
            _log.warning("storage: %s refused a call: %s: %s", self.link.what, type(e).__name__, e)
            raise _Unserved from e
        except BaseException:
            self.link.abandon()
            raise
        self.link.reached()
        return out

    def _exist_many(self, keys: Sequence[bytes], kind: ValueKind) -> list[bool]:
        if not keys:
            return []

        def run() -> list[object]:
            pipe = self._redis.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._name(k, kind))
            return pipe.execute()

        try:
            answers = self._call(run)
        except _Unserved:
            return [False] * len(keys)
        return [a == 1 for a in answers]

    def _accept(self, key: bytes, name: bytes, value: bytes | None, kind: ValueKind, dest: Buffer) -> bool:
        """Verify one stored value and copy its payload into `dest`; count the outcome."""
        if value is None:
            self.counters.add(num_misses=1)
            return False
        why = self.codec.decode_into(value, kind, key, dest)
        if why is not None:
            self.counters.add(num_corrupt=1)
            _log.warning(
                "storage: %s holds a bad value under %s (%s); deleted, treated as a miss",
                self.link.what,
                name.decode(),
                why,
            )
            try:
                # Best effort: a good copy can only replace it once it is gone (writes use NX).
                self._call(lambda: self._redis.delete(name))
            except _Unserved:
                pass
            return False
        if kind is ValueKind.KV:
            self.counters.add(num_read_pages=1, num_read_bytes=len(value))
        else:
            self.counters.add(num_read_states=1, num_read_bytes=len(value))
        return True

    def _set_many(
        self, keys: Sequence[bytes], blobs: Sequence[Buffer], kind: ValueKind, token_count: int
    ) -> list[bool]:
        if not keys:
            return []
        values = []
        for key, blob in zip(keys, blobs):
            payload = memoryview(blob).cast("B")
            values.append(b"".join((self.codec.header(kind, key, payload, token_count), payload)))

        def run() -> list[object]:
            pipe = self._redis.pipeline(transaction=False)
            for key, value in zip(keys, values):
                pipe.set(self._name(key, kind), value, nx=True)
            return pipe.execute(raise_on_error=False)

        try:
            answers = self._call(run)
        except _Unserved:
            return [False] * len(keys)
        out: list[bool] = []
        written = skipped = refused = nbytes = 0
        for answer, value in zip(answers, values):
            if answer is True:
                written += 1
                nbytes += len(value)
                out.append(True)
            elif answer is None:  # NX: already stored (by us or another server)
                skipped += 1
                out.append(True)
            else:  # OOM under `noeviction`, or another per-command error: best effort
                refused += 1
                out.append(False)
                if not isinstance(answer, redis.exceptions.OutOfMemoryError):
                    _log.warning("storage: %s refused a write: %s", self.link.what, answer)
        if kind is ValueKind.KV:
            self.counters.add(num_written_pages=written, num_written_bytes=nbytes)
        else:
            self.counters.add(num_written_states=written, num_written_bytes=nbytes)
        self.counters.add(num_skipped_writes=skipped, num_refused_writes=refused)
        return out
