"""The storage-tier contract: a backend stores token pages (KV) and recurrent states under page keys.

Keys come from `himamba.services.cache.keys.page_keys`. A page's KV is stored under its key; a
recurrent state is stored under the key of the page where it was captured, as a separate value
(kind STATE), so the backend answers "which of these pages has a state" without reading it.

Every stored value is `header || payload`. The header carries a format version, the model
fingerprint, the kind, the page key, a token count, the payload length and a CRC-32 over header and
payload. A value whose header or checksum does not verify is a MISS (counted as corrupt), never
data: a backend must not hand unverified bytes to a caller as a hit.

Backend contract (what every implementation promises):
- Thread safety: methods are called from the storage I/O worker threads, several at a time, on
  one instance. Every method must be safe to call concurrently, including for the same key.
- Best-effort writes: `set_*` may refuse a value (store full, read-only, unreachable): it returns
  False for it and counts it. An acknowledged value may still vanish later (eviction by the store
  or by another server), so `exists` answers are hints: `get_*` re-verifies.
- Partial reads: `get_pages` fills destinations in order and returns how many LEADING pages were
  read and verified. Bytes of `dest[n:]` are unspecified (possibly written): callers use only
  `dest[:n]`.
- Failure: a miss, a corrupt value and a refused write are return values, never exceptions. A
  backend that cannot serve at all (I/O error on the device, store unreachable) may raise; the
  I/O workers turn any exception into a failed job. The remote backends (redis, mooncake) do not
  raise for an unreachable store: they answer misses / refused writes, count `num_errors`, fail
  fast while the store is away and reconnect on their own (reconnect.py).
- No synchronous deletes: nothing relies on a value being gone after a call returns.
"""

from __future__ import annotations

import struct
import threading
import zlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from enum import IntEnum
from typing import ClassVar, NamedTuple, TypeAlias

import msgspec

from himamba.services.cache.keys import FINGERPRINT_BYTES, KEY_BYTES

__all__ = [
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "Buffer",
    "StorageBackend",
    "StorageCounters",
    "StorageError",
    "StorageHit",
    "StorageStats",
    "ValueCodec",
    "ValueKind",
    "check_batch",
    "find_hit",
]

# Anything with the buffer protocol (numpy arrays of host-pool rows included); Python 3.11 has no
# collections.abc.Buffer.
Buffer: TypeAlias = "bytes | bytearray | memoryview"

try:  # ISA-L's CRC-32: the same checksum as zlib's, at memory speed (zlib's would cap the file tier)
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is a dependency; the values are identical without it
    _crc32 = zlib.crc32

FORMAT_VERSION = 1
_MAGIC = b"HMBS"
# magic, version, kind, flags, token_count, payload_bytes, fingerprint, key, reserved, crc32
_HEADER = struct.Struct("<4sHBBIQ32s32s8xI")
HEADER_BYTES = _HEADER.size  # 96
_CRC_OFFSET = HEADER_BYTES - 4
_CRC = struct.Struct("<I")
assert HEADER_BYTES == 96 and KEY_BYTES == 32 and FINGERPRINT_BYTES == 32


class ValueKind(IntEnum):
    """What a stored value holds."""

    KV = 1  # one host page: every attention layer's K and V for `page_size` tokens
    STATE = 2  # one host state slot: every recurrent layer's state at the page's last token


class StorageError(Exception):
    """A backend could not serve a call at all (device error, store unreachable)."""


class ValueCodec:
    """Encodes and verifies value headers for one model fingerprint. Stateless, thread-safe."""

    def __init__(self, fingerprint: bytes) -> None:
        if len(fingerprint) != FINGERPRINT_BYTES:
            raise ValueError(f"fingerprint: must be {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}")
        self.fingerprint = bytes(fingerprint)

    def header(self, kind: ValueKind, key: bytes, payload: Buffer, token_count: int = 0) -> bytes:
        """The header to store in front of `payload` (the checksum covers both)."""
        if len(key) != KEY_BYTES:
            raise ValueError(f"key: must be {KEY_BYTES} bytes, got {len(key)}")
        nbytes = memoryview(payload).nbytes
        head = _HEADER.pack(_MAGIC, FORMAT_VERSION, kind, 0, token_count, nbytes, self.fingerprint, key, 0)
        crc = _crc32(payload, _crc32(memoryview(head)[:_CRC_OFFSET]))
        return head[:_CRC_OFFSET] + struct.pack("<I", crc)

    def header_into(self, buf: memoryview, kind: ValueKind, key: bytes, payload: Buffer, token_count: int = 0) -> None:
        """`header(...)` written into `buf` (HEADER_BYTES, writable): no allocation per value."""
        if len(key) != KEY_BYTES:
            raise ValueError(f"key: must be {KEY_BYTES} bytes, got {len(key)}")
        nbytes = memoryview(payload).nbytes
        _HEADER.pack_into(buf, 0, _MAGIC, FORMAT_VERSION, kind, 0, token_count, nbytes, self.fingerprint, key, 0)
        _CRC.pack_into(buf, _CRC_OFFSET, _crc32(payload, _crc32(buf[:_CRC_OFFSET])))

    def problem(self, header: Buffer, kind: ValueKind, key: bytes, payload_bytes: int) -> str | None:
        """Why `header` cannot describe the expected value; None when it can (the checksum is
        checked separately, once the payload is read)."""
        head = memoryview(header)
        if head.nbytes != HEADER_BYTES:
            return f"short header ({head.nbytes} bytes)"
        magic, version, k, _flags, _tokens, nbytes, fp, stored_key, _crc = _HEADER.unpack(head)
        if magic != _MAGIC:
            return "bad magic"
        if version != FORMAT_VERSION:
            return f"format version {version}, expected {FORMAT_VERSION}"
        if k != kind:
            return f"kind {k}, expected {int(kind)}"
        if fp != self.fingerprint:
            return "another model's fingerprint"
        if stored_key != key:
            return "stored under another key"
        if nbytes != payload_bytes:
            return f"payload of {nbytes} bytes, expected {payload_bytes}"
        return None

    def describe(self, header: Buffer) -> tuple[ValueKind, bytes, int] | None:
        """(kind, key, payload bytes) of a header of this model's format, or None when it is not one
        (how a segment scan finds where a torn tail begins; the checksum is checked on read)."""
        head = memoryview(header)
        if head.nbytes != HEADER_BYTES:
            return None
        magic, version, k, _flags, _tokens, nbytes, fp, key, _crc = _HEADER.unpack(head)
        if magic != _MAGIC or version != FORMAT_VERSION or fp != self.fingerprint or k not in (1, 2):
            return None
        return ValueKind(k), bytes(key), nbytes

    def verified(self, header: Buffer, kind: ValueKind, key: bytes, payload: Buffer) -> bool:
        """`problem(...) is None and checksum_ok(...)` in one pass (the read path's hot loop)."""
        magic, version, k, _flags, _tokens, nbytes, fp, stored_key, stored = _HEADER.unpack(header)
        return (
            stored_key == key
            and magic == _MAGIC
            and version == FORMAT_VERSION
            and k == kind
            and nbytes == memoryview(payload).nbytes
            and fp == self.fingerprint
            and _crc32(payload, _crc32(memoryview(header)[:_CRC_OFFSET])) == stored
        )

    @staticmethod
    def checksum_ok(header: Buffer, payload: Buffer) -> bool:
        """Whether the CRC-32 in `header` matches header and payload."""
        head = memoryview(header)
        (stored,) = struct.unpack_from("<I", head, _CRC_OFFSET)
        return _crc32(payload, _crc32(head[:_CRC_OFFSET])) == stored

    def check(self, blob: Buffer, kind: ValueKind, key: bytes, payload_bytes: int) -> str | None:
        """Why a whole stored value (`header || payload`) is not the expected one; None when it is."""
        view = memoryview(blob)
        if view.nbytes != HEADER_BYTES + payload_bytes:
            return f"value of {view.nbytes} bytes, expected {HEADER_BYTES + payload_bytes}"
        head, payload = view[:HEADER_BYTES], view[HEADER_BYTES:]
        why = self.problem(head, kind, key, payload_bytes)
        if why is None and not self.checksum_ok(head, payload):
            why = "checksum mismatch"
        return why

    def decode_into(self, blob: Buffer, kind: ValueKind, key: bytes, dest: Buffer) -> str | None:
        """Verify a whole stored value (`header || payload`, as a remote store returns it) and copy
        its payload into `dest`; returns why it is not the expected value, None on success."""
        out = memoryview(dest).cast("B")
        why = self.check(blob, kind, key, out.nbytes)
        if why is None:
            out[:] = memoryview(blob)[HEADER_BYTES:].cast("B")
        return why


class StorageStats(msgspec.Struct, frozen=True, kw_only=True):
    """Counters of one backend since it was opened (monotonic, except `used_bytes`)."""

    num_read_pages: int = 0
    num_read_states: int = 0
    num_read_bytes: int = 0
    num_written_pages: int = 0
    num_written_states: int = 0
    num_written_bytes: int = 0
    num_skipped_writes: int = 0  # already stored: not written again
    num_misses: int = 0  # values asked for and absent
    num_corrupt: int = 0  # values present that failed verification (treated as misses)
    num_refused_writes: int = 0  # store full, read-only, or failed
    num_evicted: int = 0  # values removed to respect a size cap
    num_errors: int = 0  # calls the store could not serve (unreachable, or failing fast while it is away)
    num_reconnects: int = 0  # times the store came back after being unreachable
    used_bytes: int = 0  # bytes this backend believes it holds; 0 when it cannot know
    used_state_bytes: int = 0  # the part of used_bytes holding recurrent states, where known
    capacity_bytes: int = 0  # 0: no cap
    reachable: bool = True  # False while a remote store is considered away (calls fail fast)


class StorageCounters:
    """Thread-safe accumulator behind `StorageBackend.stats()`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int | bool] = dict.fromkeys(StorageStats.__struct_fields__, 0)
        self._values["reachable"] = True  # a backend serves until it says otherwise

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta

    def snapshot(self, **overrides: int | bool) -> StorageStats:
        with self._lock:
            values = dict(self._values)
        values.update(overrides)
        return StorageStats(**values)


class StorageBackend(ABC):
    """A store of KV pages and recurrent states keyed by page keys; see the module docstring for
    the contract every implementation keeps (thread-safe, best-effort writes, verified reads)."""

    name: ClassVar[str]

    def __init__(self, fingerprint: bytes) -> None:
        self.codec = ValueCodec(fingerprint)
        self.counters = StorageCounters()

    @property
    def fingerprint(self) -> bytes:
        return self.codec.fingerprint

    @abstractmethod
    def exists(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` have a KV page stored (stops at the first absent one)."""

    @abstractmethod
    def exists_states(self, keys: Sequence[bytes]) -> list[bool]:
        """For each page key, whether a recurrent state captured at that page is stored."""

    @abstractmethod
    def get_pages(self, keys: Sequence[bytes], dest: Sequence[Buffer]) -> int:
        """Read page `keys[i]` into the writable buffer `dest[i]` (exactly one page payload each);
        returns how many leading pages were read and verified. Stops at the first miss."""

    @abstractmethod
    def set_pages(self, keys: Sequence[bytes], blobs: Sequence[Buffer], token_count: int = 0) -> list[bool]:
        """Store page payloads; per key, whether it is stored now (True also when it already was).
        `token_count` (tokens per page) is recorded in each header."""

    @abstractmethod
    def get_state(self, key: bytes, dest: Buffer) -> bool:
        """Read the state stored at page `key` into `dest`; False on a miss or a corrupt value."""

    @abstractmethod
    def set_state(self, key: bytes, blob: Buffer) -> bool:
        """Store a state captured at page `key`; whether it is stored now."""

    @abstractmethod
    def close(self) -> None:
        """Release resources; later calls raise RuntimeError."""

    def stats(self) -> StorageStats:
        """A snapshot of this backend's counters."""
        return self.counters.snapshot()


def check_batch(keys: Sequence[bytes], bufs: Sequence[Buffer], field: str) -> None:
    """ValueError unless `keys` and `bufs` pair up one to one (a helper for backends)."""
    if len(keys) != len(bufs):
        raise ValueError(f"{field}: {len(bufs)} buffers for {len(keys)} keys")
    for k in keys:
        if len(k) != KEY_BYTES:
            raise ValueError(f"keys: every key must be {KEY_BYTES} bytes, got {len(k)}")


class StorageHit(NamedTuple):
    """What storage holds for a run of page keys. A hybrid hit is one unit: KV pages and the state
    at exactly the same position, so `num_pages` ends at a page with a stored state."""

    num_kv_pages: int  # leading pages whose KV is stored
    num_pages: int  # usable hit: <= num_kv_pages, and (when a state is needed) ends at a state
    # With a state needed: every usable hit length (page counts <= num_pages ending at a stored
    # state), ascending, so a truncated or partial fetch can end at one without asking again.
    state_pages: tuple[int, ...] = ()


def find_hit(backend: StorageBackend, keys: Sequence[bytes], *, needs_state: bool) -> StorageHit:
    """The longest usable prefix of `keys` in `backend`. With `needs_state` (hybrid models) the
    hit is cut back to the deepest page that has both its KV prefix and a state stored."""
    num_kv = backend.exists(keys)
    if not needs_state or num_kv == 0:
        return StorageHit(num_kv, num_kv)
    has_state = backend.exists_states(keys[:num_kv])
    ends = tuple(i + 1 for i, ok in enumerate(has_state) if ok)
    return StorageHit(num_kv, ends[-1] if ends else 0, ends)
