"""Start real `himamba serve` processes for benchmarks and tests: unique endpoints, readiness,
the cache controller's stats probe, and stop by PID (process group) so nothing outlives a run."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

from himamba.common.messages import CacheStats, GetCacheStats
from himamba.common.runtime_dir import ensure_private_dir, runtime_base, socket_endpoint
from himamba.common.wire import encode

ENDPOINT_FIELDS = ("zmq_endpoint", "tokenizer_ipc", "scheduler_ipc", "worker_ipc", "cache_ipc", "control_ipc")


def unique_endpoints(prefix: str = "himamba-run") -> dict[str, str]:
    """A fresh instance's endpoints section for services started by hand (benches, in-process
    tests): its name, a private runtime directory of its own, and the sockets in it."""
    tag = uuid.uuid4().hex[:12]
    instance = f"{prefix}-{tag}"
    runtime_dir = tempfile.mkdtemp(prefix="himamba-ep-")  # 0700, ours
    directory = ensure_private_dir(Path(runtime_dir) / instance)
    return {
        "instance": instance,
        "runtime_dir": runtime_dir,
        **{n: socket_endpoint(directory, n) for n in ENDPOINT_FIELDS},
    }


def instance_endpoints(instance: str, runtime_dir: str = "") -> dict[str, str]:
    """Where a `himamba serve --instance NAME` (run as this user) binds its endpoints."""
    directory = runtime_base(runtime_dir) / instance
    return {n: socket_endpoint(directory, n) for n in ENDPOINT_FIELDS}


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _flag_value(flags: tuple[str, ...], name: str) -> str | None:
    return flags[flags.index(name) + 1] if name in flags else None


def himamba_command() -> list[str]:
    # -P: the current directory must never shadow our packages
    return [sys.executable, "-P", "-m", "himamba.services.cli"]


@dataclass
class ServerProcess:
    """A running `himamba serve` (its own process group)."""

    proc: subprocess.Popen[bytes]
    endpoints: dict[str, str]
    log_path: Path
    own_instance_dir: Path | None = None  # a runtime directory made for this run: removed after it stops
    own_scratch_dir: Path | None = None  # its storage tier, in the system's temp directory: removed too

    @property
    def endpoint(self) -> str:
        return self.endpoints["zmq_endpoint"]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def cache_stats(self, check_invariants: bool = True, timeout_s: float = 10.0) -> CacheStats:
        """Ask the cache controller for pool occupancy (and an invariant check)."""
        ctx = zmq.Context.instance()
        reply_to = f"ipc://@himamba-stats-{uuid.uuid4().hex}"
        pull = ctx.socket(zmq.PULL)
        pull.bind(reply_to)
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(self.endpoints["cache_ipc"])
        try:
            push.send_multipart(encode(GetCacheStats(reply_to=reply_to, check_invariants=check_invariants)))
            if not pull.poll(int(timeout_s * 1000)):
                raise TimeoutError("the cache controller did not answer")
            return msgspec.msgpack.decode(pull.recv(), type=CacheStats)
        finally:
            pull.close(0)
            push.close(0)

    def stop(self, timeout_s: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for own in (self.own_instance_dir, self.own_scratch_dir):
            if own is not None:
                shutil.rmtree(own, ignore_errors=True)
        return self.proc.returncode


def start_server(
    model_dir: Path | str,
    log_dir: Path,
    *flags: str,
    ready_timeout_s: float = 180.0,
    wrapper: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> ServerProcess:
    """Run `himamba serve` on `model_dir` as its own instance (HTTP off unless `--port` is
    given) and wait for its ready line. `wrapper` prefixes the command (e.g. prlimit), `env`
    adds to the environment."""
    instance = _flag_value(flags, "--instance")
    args = [*wrapper, *himamba_command(), "serve", "--model", str(model_dir)]
    own_dir = None
    if instance is None:
        instance = f"t-{uuid.uuid4().hex[:12]}"
        args += ["--instance", instance]
        own_dir = runtime_base(_flag_value(flags, "--runtime-dir") or "") / instance
    endpoints = instance_endpoints(instance, _flag_value(flags, "--runtime-dir") or "")
    for name in ENDPOINT_FIELDS:  # endpoints set one by one
        given = _flag_value(flags, "--" + name.replace("_", "-"))
        if given:
            endpoints[name] = given
    if "--torch-threads" not in flags:
        args += ["--torch-threads", "1"]
    if "--port" not in flags:
        args += ["--port", "0"]
    log_dir.mkdir(parents=True, exist_ok=True)
    scratch = None
    if _flag_value(flags, "--hicache-storage-backend") == "file" and "--hicache-storage-dir" not in flags:
        # A file tier asked for without a place: a fresh one per server (runs must not see each other's
        # stored prefixes), as scratch data in the temp directory, removed at stop: never left beside a
        # run's results. Without the flag there is no disk tier (it is opt-in).
        scratch = Path(tempfile.mkdtemp(prefix="himamba-storage-"))
        args += ["--hicache-storage-dir", str(scratch)]
    args += list(flags)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"server-{uuid.uuid4().hex[:6]}.log"
    full_env = dict(os.environ, PYTHONSAFEPATH="1", **(env or {}))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    server = ServerProcess(proc, endpoints, log_path, own_dir, scratch)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if "himamba is ready" in server.log():
            return server
        if proc.poll() is not None:
            server.stop()  # removes what was made for it
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()[-4000:]}")
        time.sleep(0.1)
    server.stop()
    raise TimeoutError(f"server not ready in {ready_timeout_s}s:\n{server.log()[-4000:]}")
