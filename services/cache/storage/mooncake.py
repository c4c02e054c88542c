"""The `mooncake` storage backend: pages and states as objects in a Mooncake Store, shared by
every server connected to the same master.

himamba is a pure client (`global_segment_size=0`): the memory belongs to `mooncake_client`
processes (or other clients that mount segments), so the cache outlives our restarts. Objects are
`<prefix><page key hex>:kv` / `...:st`, each `header || payload` (base.py), moved zero-copy with
the multi-buffer batch calls: the header lands in a small scratch row, the payload straight in the
caller's buffer (a host-pool page). Over RDMA the caller's buffers must be registered first
(`register_memory`, once per host pool); over TCP nothing needs registering.

What the store does, and what we do about it:
- A put answers 0 once the object is stored: only then is a page acknowledged. A full pool
  answers -200 (no space) while its asynchronous eviction catches up: a refused write, counted.
  Objects are evicted later (watermark eviction, once their lease expired): `exists` is a hint.
- A put of a key that already exists is answered 0 and does not replace it, so a batch first asks
  which keys exist and sends only the others (counted as skipped).
- A read whose object has another size, header or checksum is a miss, counted as corrupt.
- Deletes are refused while an object is leased (-706): nothing here relies on them.
- When the master goes away, a call fails after the client's RPC timeout (about 4 s); the backend
  then fails fast (misses, refused writes, `num_errors`) and lets one call through after each
  backoff (reconnect.py). The client library reconnects by itself when the master is back, and the
  segment owners re-mount their memory, so nothing is restarted.
- `setup` holds the GIL while it retries, so it is only attempted once the master and the
  metadata server accept TCP connections, from a background thread, with the library's own setup
  retries cut to 1 (`MC_STORE_CLIENT_SETUP_RETRIES`, unless set already).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal
from urllib.parse import urlsplit

import numpy as np

from himamba.services.cache.storage.base import (
    HEADER_BYTES,
    Buffer,
    ValueKind,
    check_batch,
)
from himamba.services.cache.storage.reconnect import ReconnectGate, StoreLink
from himamba.services.cache.storage.remote import RemoteBackend

__all__ = ["DEFAULT_MOONCAKE_MASTER", "MooncakeBackend", "default_metadata_server"]

_log = logging.getLogger("himamba.cache.storage")
DEFAULT_MOONCAKE_MASTER = "127.0.0.1:50051"  # mooncake_master's default RPC port
_EMBEDDED_METADATA_PORT = 8080  # mooncake_master --enable_http_metadata_server's default port
_SUFFIX = {ValueKind.KV: ":kv", ValueKind.STATE: ":st"}

# Mooncake's ErrorCode values that change what we do (mooncake-store types.h).
_NO_SPACE = -200  # NO_AVAILABLE_HANDLE
_BUFFER_TOO_SMALL = -600  # INVALID_PARAMS: the object is larger than the destination
_MISSING = frozenset({-703, -704, -707})  # replica not ready, object not found, lease expired
_ALREADY_EXISTS = -705
_TRANSFER_FAIL = -800  # also what a too-small object gives: told apart with get_size
_QUOTA_EXCEEDED = -1700


def _unreachable(code: int) -> bool:
    """RPC_FAIL / RPC_TIMEOUT and the -9xx range, or the -1 a batch exists answers on error."""
    return -999 <= code <= -900 or code == -1


def default_metadata_server(master_address: str) -> str:
    """The HTTP metadata server that `mooncake_master --enable_http_metadata_server` embeds."""
    host, _ = _split_address(master_address, "hicache_storage_url")
    return f"http://{host}:{_EMBEDDED_METADATA_PORT}/metadata"


def _split_address(address: str, field: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{field}: expected host:port (the Mooncake master's RPC address), got {address!r}")
    return host.strip("[]"), int(port)


def _local_address_towards(host: str) -> str:
    """The address of this machine that `host` would see (no packet is sent)."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _accepts(host: str, port: int, timeout_s: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _pointer(buf: Buffer) -> tuple[int, int]:
    """(address, bytes) of a C-contiguous buffer; it must stay alive while the address is used."""
    arr = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
    return arr.ctypes.data, arr.nbytes


def _real_client() -> Any:
    from mooncake.store import (
        MooncakeDistributedStore,  # optional dependency: imported when used
    )

    return MooncakeDistributedStore()


class MooncakeBackend(RemoteBackend):
    """Values in a Mooncake Store whose master is at `master_address` (host:port); see the module
    docstring. `metadata_server` defaults to the master's embedded HTTP metadata server.
    `local_hostname` is the address the store's peers reach this process at (default: the local
    address facing the master). The constructor waits up to `connect_wait_s` for a first
    connection attempt; when the store is not there, it keeps trying in the background (backoff
    `backoff_base_s` doubling to `backoff_max_s`) and calls fail fast meanwhile."""

    name = "mooncake"

    def __init__(
        self,
        fingerprint: bytes,
        master_address: str = DEFAULT_MOONCAKE_MASTER,
        *,
        metadata_server: str = "",
        protocol: Literal["tcp", "rdma"] = "tcp",
        rdma_devices: str = "",
        local_hostname: str = "",
        local_buffer_bytes: int = 16 << 20,
        key_prefix: str = "himamba:",
        connect_wait_s: float = 10.0,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 30.0,
        client_factory: Callable[[], Any] = _real_client,
    ) -> None:
        super().__init__(fingerprint)
        self._master_host, self._master_port = _split_address(master_address, "hicache_storage_url")
        if protocol not in ("tcp", "rdma"):
            raise ValueError(f"mooncake_protocol: must be 'tcp' or 'rdma', got {protocol!r}")
        if local_buffer_bytes < 0:
            raise ValueError(f"local_buffer_bytes: must be >= 0, got {local_buffer_bytes}")
        self.master_address = master_address
        self.metadata_server = metadata_server or default_metadata_server(master_address)
        self.protocol = protocol
        self.rdma_devices = rdma_devices
        self.local_hostname = local_hostname or _local_address_towards(self._master_host)
        self.local_buffer_bytes = local_buffer_bytes
        self.key_prefix = key_prefix
        self._factory = client_factory
        gate = ReconnectGate(backoff_base_s, backoff_max_s)
        self.link = StoreLink(f"mooncake master {master_address}", self.counters, gate)
        self._lock = threading.Lock()  # guards _client, _closed, _registered, _pinned
        self._client: Any = None
        self._closed = False
        self._closing = threading.Event()
        self._connected = threading.Event()
        self._tried = threading.Event()  # the first connection attempt is over
        self._registered: list[tuple[int, int]] = []  # (address, bytes) given to register_memory
        self._pinned: list[np.ndarray] = []  # scratch rows registered with the store (RDMA)
        self._tls = threading.local()
        self._connector = threading.Thread(
            target=self._connect_loop,
            args=(backoff_base_s, backoff_max_s),
            name="himamba-mooncake-connect",
            daemon=True,
        )
        self._connector.start()
        self._tried.wait(connect_wait_s)

    @property
    def connected(self) -> bool:
        """Whether the client is set up (the store may still be away; see `link.gate`)."""
        return self._connected.is_set()

    # ---- connecting ----------------------------------------------------------------------------

    def _connect_loop(self, delay_s: float, max_s: float) -> None:
        metadata = urlsplit(self.metadata_server)
        logged = False
        while not self._closing.is_set():
            reachable = _accepts(self._master_host, self._master_port) and (
                metadata.scheme != "http" or _accepts(metadata.hostname or "", metadata.port or 80)
            )
            try:
                client = self._setup() if reachable else None
            except Exception:  # noqa: BLE001 - this thread must keep trying, whatever the library does
                _log.exception("storage: setting up a client of %s failed", self.link.what)
                client = None
            if client is not None:
                with self._lock:
                    if self._closed:
                        client.close()
                        return
                    self._client = client
                    for address, nbytes in self._registered:
                        self._register(client, address, nbytes)
                self._connected.set()
                self._tried.set()
                _log.info(
                    "storage: connected to %s (metadata %s, %s)", self.link.what, self.metadata_server, self.protocol
                )
                return
            self._tried.set()
            if not logged:
                _log.warning(
                    "storage: cannot set up a client of %s (metadata %s); storage calls fail fast until it is reachable",
                    self.link.what,
                    self.metadata_server,
                )
                logged = True
            self._closing.wait(delay_s)
            delay_s = min(2 * delay_s, max_s)

    def _setup(self) -> Any:
        # setup() holds the GIL for the library's whole retry loop (20 x ~4.4 s by default): one
        # try is enough, as this loop retries (with the GIL free).
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
        client = self._factory()
        rc = client.setup(
            self.local_hostname,
            self.metadata_server,
            0,  # global_segment_size: a pure client, the memory is the segment owners'
            self.local_buffer_bytes,
            self.protocol,
            self.rdma_devices,
            self.master_address,
        )
        if rc == 0:
            return client
        _log.debug("storage: mooncake setup answered %s", rc)
        try:
            client.close()
        except Exception as e:  # noqa: BLE001 - a half set-up client: nothing more to do with it
            _log.debug("storage: closing a mooncake client that failed its setup: %s", e)
        return None

    def register_memory(self, buf: Buffer) -> None:
        """Make `buf` (a host pool, whole) usable as a zero-copy source and destination. Required
        over RDMA before its pages are read or written; a no-op over TCP. Keep `buf` alive until
        `close()`."""
        if self.protocol != "rdma":
            return
        address, nbytes = _pointer(buf)
        with self._lock:
            self._registered.append((address, nbytes))
            if self._client is not None:
                self._register(self._client, address, nbytes)

    def _register(self, client: Any, address: int, nbytes: int) -> None:
        rc = client.register_buffer(address, nbytes)
        if rc != 0:
            _log.warning(
                "storage: %s refused to register %d bytes of memory (%s); transfers from it will fail",
                self.link.what,
                nbytes,
                rc,
            )

    def _headers(self, n: int) -> np.ndarray:
        """This thread's scratch rows for `n` headers (registered with the store over RDMA)."""
        rows: np.ndarray | None = getattr(self._tls, "headers", None)
        if rows is None or len(rows) < n:
            rows = np.zeros((max(n, 16), HEADER_BYTES), dtype=np.uint8)
            if self.protocol == "rdma":
                with self._lock:
                    self._pinned.append(rows)  # never freed while registered
                    if self._client is not None:
                        self._register(self._client, rows.ctypes.data, rows.nbytes)
                    self._registered.append((rows.ctypes.data, rows.nbytes))
            self._tls.headers = rows
        return rows

    # ---- the contract --------------------------------------------------------------------------

    def get_pages(self, keys: Sequence[bytes], dest: Sequence[Buffer]) -> int:
        self._check_open()
        check_batch(keys, dest, "dest")
        return self._get_prefix(keys, dest, ValueKind.KV)

    def get_state(self, key: bytes, dest: Buffer) -> bool:
        self._check_open()
        check_batch([key], [dest], "dest")
        return self._get_prefix([key], [dest], ValueKind.STATE) == 1

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            client, self._client = self._client, None
        self._closing.set()
        if client is not None:
            try:
                client.close()
            except Exception as e:  # noqa: BLE001 - closing a client of a vanished store
                _log.warning("storage: closing the mooncake client failed: %s", e)

    # ---- helpers -------------------------------------------------------------------------------

    def _name(self, key: bytes, kind: ValueKind) -> str:
        return self.key_prefix + key.hex() + _SUFFIX[kind]

    def _admit(self) -> Any:
        """The client to call, or None (counted as an error) while not connected or failing fast."""
        client = self._client
        if client is None:
            self.counters.add(num_errors=1)
            return None
        return client if self.link.admit() else None

    def _settle(self, codes: Sequence[int], what: str) -> None:
        """Report a batch call's per-key codes to the reconnect gate."""
        bad = next((c for c in codes if _unreachable(c)), None)
        if bad is None:
            self.link.reached()
        else:
            self.link.lost(f"{what} answered {bad}")

    def _exist_many(self, keys: Sequence[bytes], kind: ValueKind) -> list[bool]:
        if not keys:
            return []
        client = self._admit()
        if client is None:
            return [False] * len(keys)
        codes = self._exist_codes(client, [self._name(k, kind) for k in keys])
        return [c == 1 for c in codes]

    def _exist_codes(self, client: Any, names: list[str]) -> list[int]:
        """batch_is_exist for an admitted call, reported to the gate: 1 present, 0 absent, < 0
        failed."""
        try:
            codes = list(client.batch_is_exist(names))
        except BaseException:
            self.link.abandon()
            raise
        self._settle(codes, "batch_is_exist")
        return codes

    def _get_prefix(self, keys: Sequence[bytes], dest: Sequence[Buffer], kind: ValueKind) -> int:
        """Read every key into its destination in one call; how many leading values arrived whole
        and verified. Like a prefix read, it looks no further than the first failure."""
        if not keys:
            return 0
        client = self._admit()
        if client is None:
            return 0
        heads = self._headers(len(keys))
        names = [self._name(k, kind) for k in keys]
        targets = [_pointer(b) for b in dest]
        try:
            codes = list(
                client.batch_get_into_multi_buffers(
                    names,
                    [[heads[i].ctypes.data, address] for i, (address, _) in enumerate(targets)],
                    [[HEADER_BYTES, nbytes] for _, nbytes in targets],
                )
            )
        except BaseException:
            self.link.abandon()
            raise
        self._settle(codes, "batch_get_into_multi_buffers")
        n = 0
        for i, (key, name, code, buf) in enumerate(zip(keys, names, codes, dest)):
            nbytes = HEADER_BYTES + targets[i][1]
            if not self._whole(client, name, code, nbytes):
                break
            why = self.codec.problem(heads[i], kind, key, targets[i][1])
            if why is None and not self.codec.checksum_ok(heads[i], buf):
                why = "checksum mismatch"
            if why is not None:
                self._discard(client, name, why)
                # The rest of the batch arrived in the same call: remove every other bad value
                # now, so one backup replaces them all.
                for j in range(i + 1, len(keys)):
                    if codes[j] == HEADER_BYTES + targets[j][1] and not (
                        self.codec.problem(heads[j], kind, keys[j], targets[j][1]) is None
                        and self.codec.checksum_ok(heads[j], dest[j])
                    ):
                        self._discard(client, names[j], "corrupt (found beside another)")
                break
            if kind is ValueKind.KV:
                self.counters.add(num_read_pages=1, num_read_bytes=nbytes)
            else:
                self.counters.add(num_read_states=1, num_read_bytes=nbytes)
            n += 1
        return n

    def _whole(self, client: Any, name: str, code: int, expected: int) -> bool:
        """Whether a get's answer is a whole object of `expected` bytes; counts why not."""
        if code == expected:
            return True
        if code in _MISSING:
            self.counters.add(num_misses=1)
            return False
        if _unreachable(code):
            return False  # counted by _settle
        if code == _BUFFER_TOO_SMALL or code >= 0:
            self._discard(client, name, f"an object that is not {expected} bytes (answer {code})")
            return False
        if code == _TRANSFER_FAIL:
            size = client.get_size(name)
            if size >= 0 and size != expected:
                self._discard(client, name, f"an object of {size} bytes, expected {expected}")
                return False
        self.counters.add(num_errors=1)
        _log.warning("storage: %s failed to read %s: %s", self.link.what, name, code)
        return False

    def _discard(self, client: Any, name: str, why: str) -> None:
        self.counters.add(num_corrupt=1)
        _log.warning("storage: %s holds a bad value under %s (%s); treated as a miss", self.link.what, name, why)
        # Best effort (refused while leased): a good copy can only be stored once it is gone.
        client.remove(name)

    def _set_many(
        self, keys: Sequence[bytes], blobs: Sequence[Buffer], kind: ValueKind, token_count: int
    ) -> list[bool]:
        if not keys:
            return []
        client = self._admit()
        if client is None:
            return [False] * len(keys)
        names = [self._name(k, kind) for k in keys]
        present = self._exist_codes(client, names)
        if any(_unreachable(c) for c in present):
            return [False] * len(keys)
        todo = [i for i, c in enumerate(present) if c != 1]
        skipped = len(keys) - len(todo)
        out = [True] * len(keys)
        if not todo:
            self.counters.add(num_skipped_writes=skipped)
            return out
        heads = self._headers(len(todo))
        sources = []
        for j, i in enumerate(todo):
            payload = memoryview(blobs[i]).cast("B")
            heads[j] = np.frombuffer(self.codec.header(kind, keys[i], payload, token_count), dtype=np.uint8)
            sources.append(_pointer(payload))
        try:
            codes = list(
                client.batch_put_from_multi_buffers(
                    [names[i] for i in todo],
                    [[heads[j].ctypes.data, address] for j, (address, _) in enumerate(sources)],
                    [[HEADER_BYTES, nbytes] for _, nbytes in sources],
                )
            )
        except BaseException:
            self.link.abandon()
            raise
        self._settle(codes, "batch_put_from_multi_buffers")
        written = refused = nbytes = 0
        for j, (i, code) in enumerate(zip(todo, codes)):
            if code == 0:
                written += 1
                nbytes += HEADER_BYTES + sources[j][1]
            elif code == _ALREADY_EXISTS:
                skipped += 1
            else:
                out[i] = False
                if code in (_NO_SPACE, _QUOTA_EXCEEDED):
                    refused += 1
                elif not _unreachable(code):
                    refused += 1
                    self.counters.add(num_errors=1)
                    _log.warning("storage: %s refused a write: %s", self.link.what, code)
        if kind is ValueKind.KV:
            self.counters.add(num_written_pages=written, num_written_bytes=nbytes)
        else:
            self.counters.add(num_written_states=written, num_written_bytes=nbytes)
        self.counters.add(num_skipped_writes=skipped, num_refused_writes=refused)
        return out
