"""Real store processes on 127.0.0.1 with free ports, for tests, benches and demos: a Redis server,
and a Mooncake Store (a `mooncake_master` with its embedded HTTP metadata server, plus one
`mooncake_client` process that owns the memory, so that himamba is a pure client).

Each process is started directly (no shell), waited on until it serves, and stopped by its PID:
SIGTERM, then SIGKILL. On Linux a child is also killed when the thread that started it ends
(PR_SET_PDEATHSIG), so a killed test run leaves no store behind: start stores from a thread that
outlives them (the main thread). `kill()` + `start()` simulate an outage on the same address.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

__all__ = [
    "LocalMooncake",
    "LocalRedis",
    "LocalStore",
    "StoreProcess",
    "free_port",
    "mooncake_binary",
    "start_local_store",
]

_PR_SET_PDEATHSIG = 1
_MIN_SEGMENT_BYTES = 16 << 20  # mooncake_client refuses smaller segments


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def mooncake_binary(name: str) -> Path:
    """The path of a binary shipped in the `mooncake` wheel (`mooncake_master`, `mooncake_client`);
    FileNotFoundError when the wheel is not installed."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{name}: the mooncake wheel (mooncake-transfer-engine-non-cuda) is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / name
    if not path.is_file():
        raise FileNotFoundError(f"{name}: not found in the mooncake wheel at {path.parent}")
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o111)
    return path


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


class StoreProcess:
    """One server process started from `argv`, its output in `log_path`."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.running else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        if self.running:
            return
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.log_path.parent,
                start_new_session=True,  # a Ctrl-C aimed at the tests does not hit the store first
                # Only prctl runs between fork and exec, so threads in this process are no hazard.
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,  # noqa: PLW1509
            )

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`; waits for the exit."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL at once (a crash), and wait for the exit."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def check_alive(self) -> None:
        if self._proc is not None and self._proc.poll() is not None:
            tail = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
            raise RuntimeError(f"{self.name} exited with {self._proc.returncode}; log tail:\n{tail}")


def _wait(what: str, ready: Callable[[], bool], procs: Sequence[StoreProcess], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        for p in procs:
            p.check_alive()
        if ready():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout_s:.0f} s")
        time.sleep(0.05)


class LocalRedis:
    """`redis-server` on 127.0.0.1 without persistence, capped at `maxmemory_bytes` with
    `policy` (allkeys-lru: the server evicts; noeviction: a full server refuses writes)."""

    def __init__(self, workdir: Path, *, maxmemory_bytes: int = 64 << 20, policy: str = "allkeys-lru") -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server: not installed (Debian: apt-get install redis-server)")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        workdir.mkdir(parents=True, exist_ok=True)
        argv = [
            binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--maxmemory", str(maxmemory_bytes),
            "--maxmemory-policy", policy,
            "--dir", str(workdir),
        ]  # fmt: skip
        self.process = StoreProcess("redis-server", argv, workdir / f"redis-{self.port}.log")

    def start(self, timeout_s: float = 20.0) -> LocalRedis:
        self.process.start()
        _wait("redis-server", self._pong, [self.process], timeout_s)
        return self

    def _pong(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        self.process.kill()

    def stop(self) -> None:
        self.process.stop()


class LocalMooncake:
    """A Mooncake Store on 127.0.0.1: `mooncake_master` (RPC, embedded HTTP metadata server,
    metrics) and a `mooncake_client` owning a `segment_bytes` segment. `lease_ttl_ms` is the
    master's object lease (objects cannot be evicted or removed while leased); `client_ttl_s` is
    how long the master keeps the segment of a client that stopped answering."""

    def __init__(
        self, workdir: Path, *, segment_bytes: int = 64 << 20, lease_ttl_ms: int = 1000, client_ttl_s: int = 10
    ) -> None:
        if segment_bytes < _MIN_SEGMENT_BYTES:
            raise ValueError(f"segment_bytes: mooncake_client needs at least {_MIN_SEGMENT_BYTES}, got {segment_bytes}")
        master, client = mooncake_binary("mooncake_master"), mooncake_binary("mooncake_client")
        workdir.mkdir(parents=True, exist_ok=True)
        self.rpc_port, self.http_port, self.metrics_port, self.client_port = (free_port() for _ in range(4))
        self.master_address = f"127.0.0.1:{self.rpc_port}"
        self.metadata_server = f"http://127.0.0.1:{self.http_port}/metadata"
        self.segment_bytes = segment_bytes
        self.master = StoreProcess(
            "mooncake_master",
            [
                str(master),
                "--rpc_address=127.0.0.1",
                f"--rpc_port={self.rpc_port}",
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.http_port}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}",
                f"--default_kv_lease_ttl={lease_ttl_ms}",
                f"--client_ttl={client_ttl_s}",
                "--logtostderr",
            ],
            workdir / f"mooncake-master-{self.rpc_port}.log",
        )
        self.client = StoreProcess(
            "mooncake_client",
            [
                str(client),
                "--host=127.0.0.1",
                f"--port={self.client_port}",
                f"--global_segment_size={segment_bytes}",
                f"--master_server_address={self.master_address}",
                f"--metadata_server={self.metadata_server}",
                "--protocol=tcp",
                "--logtostderr",
            ],
            workdir / f"mooncake-client-{self.rpc_port}.log",
        )

    def start(self, timeout_s: float = 30.0) -> LocalMooncake:
        """Start whichever of the two processes is not running, and wait until the master sees the
        segment mounted."""
        self.master.start()
        _wait(
            "mooncake_master",
            lambda: _port_open(self.rpc_port) and _port_open(self.http_port),
            [self.master],
            timeout_s,
        )
        self.client.start()
        _wait("mooncake_client's segment", self._mounted, [self.master, self.client], timeout_s)
        return self

    def master_metrics(self) -> dict[str, float]:
        """The master's unlabelled Prometheus series, e.g. `master_allocated_bytes`,
        `master_evicted_key_count`, `master_put_start_alloc_failures_total` (empty when it cannot
        be asked)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=1.0) as r:
                text = r.read().decode()
        except OSError:
            return {}
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if value and not line.startswith("#") and "{" not in name:
                out[name] = float(value)
        return out

    def capacity_bytes(self) -> int:
        """What the master reports as mounted (0 when it cannot be asked)."""
        return int(self.master_metrics().get("master_total_capacity_bytes", 0))

    def _mounted(self) -> bool:
        return self.capacity_bytes() >= self.segment_bytes

    def kill_master(self) -> None:
        self.master.kill()

    def kill_segment_owner(self) -> None:
        """SIGKILL the mooncake_client: the memory, and every object in it, is gone."""
        self.client.kill()

    def stop(self) -> None:
        self.client.stop()
        self.master.stop()


class LocalStore(NamedTuple):
    """A started local store and what a client needs to reach it."""

    address: str  # --hicache-storage-url: redis://127.0.0.1:port/0, or the Mooncake master's host:port
    metadata: str  # --mooncake-metadata-server ("" for Redis)
    stop: Callable[[], None]


def start_local_store(backend: str, workdir: Path, capacity_bytes: int = 256 << 20) -> LocalStore:
    """Start a `redis` or `mooncake` store of `capacity_bytes` in `workdir` (FileNotFoundError when
    it is not installed); the caller stops it with `.stop()`."""
    if backend == "redis":
        redis = LocalRedis(workdir, maxmemory_bytes=capacity_bytes).start()
        return LocalStore(redis.url, "", redis.stop)
    if backend == "mooncake":
        mooncake = LocalMooncake(workdir, segment_bytes=capacity_bytes).start()
        return LocalStore(mooncake.master_address, mooncake.metadata_server, mooncake.stop)
    raise ValueError(f"backend: a local store is 'redis' or 'mooncake', got {backend!r}")
