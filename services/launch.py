"""`himamba serve`: start the four services as child processes, wait until each is ready,
then supervise: a child that dies takes the others down (exit code 1, naming it); SIGINT or
SIGTERM stops them in order (exit code 0): the front door first, which refuses new requests and
gives those in flight `--shutdown-timeout` to finish (then ends them with a 503), then the back
end, where the cache flushes pending backups in what is left of that time (the rest is not
stored). Each stage has its own grace beyond that (a service is killed only past it), and one
final line says how the stop went: what each service said its stop did, and who was killed. Each service reads the config from a pipe (it can hold the API key
and a store password: it is never written to disk); a clean stop removes the instance's sockets
and lock files.

Under tensor parallelism the worker is N processes: rank 0 is the `worker` service the others talk to,
ranks 1..N-1 (`worker-rank1`, ...) follow it through the torch.distributed group (worker/rank_follower.py).
They are supervised like the services (any death stops the server) but never signalled: rank 0 tells
them to stop, or they stop when the group breaks; past the stage's grace they are killed by PID.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, NamedTuple

import msgspec
import zmq

from himamba.common.config import Config, ConfigError, HttpConfig, encode
from himamba.common.messages import Fatal, Ready, Stopped, ToLauncher
from himamba.common.openmp_wait import openmp_wait_env
from himamba.common.runtime_dir import InstanceLock, remove_runtime_files

SERVICES = ("worker", "cache", "scheduler", "tokenizer")
# The environment a worker rank reads its place in the tensor-parallel group from.
ENV_TP_RANK = "HIMAMBA_TP_RANK"
ENV_TP_INIT = "HIMAMBA_TP_INIT"
# What a service may take to stop once asked, beyond the front door's drain: closing sockets and
# exiting the interpreter (torch's teardown alone takes 1-3 s on a loaded machine).
SERVICE_STOP_S = 15.0
# How long a fatal error waits for a child's death to show before it is taken as the cause: a killed
# worker rank's sockets close (and rank 0's collective fails, and reports) before the kernel reports the
# rank's exit, later still when the machine is busy.
CAUSE_GRACE_S = 2.0


class Child(NamedTuple):
    name: str
    proc: subprocess.Popen[bytes]


def child_command(name: str, config_path: Path) -> list[str]:
    # -P keeps the current directory off sys.path, so our folders never shadow real packages.
    return [sys.executable, "-P", "-m", "himamba.services.cli", "service", name, "--config", str(config_path)]


class Launcher:
    """Spawns and supervises the services of one server."""

    def __init__(self, cfg: Config, log: logging.Logger):
        """Claim the instance (its lock) and the HTTP port, and bind the control socket; a taken
        instance or port raises ConfigError with one line that says so."""
        self.cfg = cfg
        self.log = log
        self.children: list[Child] = []
        self._signal: int | None = None
        self._lock = InstanceLock(cfg, "server")
        try:
            check_port_free(cfg.http)
        except ConfigError:
            self._lock.release()
            raise
        self.ctx = zmq.Context()
        self.control = self.ctx.socket(zmq.PULL)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        self.control.bind(cfg.endpoints.control_ipc)
        self.decoder = msgspec.msgpack.Decoder(ToLauncher)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signal = signum

    def run(self, prepare: Callable[[Config], Config] | None = None) -> int:
        """Start and supervise the services; `prepare` (building the demo model) runs first,
        while this launcher holds the instance."""
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        try:
            if prepare is not None:
                self.cfg = prepare(self.cfg)
            config = encode(self.cfg)
            tp = self.cfg.model.tensor_parallel_size
            names = [*(["worker"] + [f"worker-rank{r}" for r in range(1, tp)]), *SERVICES[1:]]
            tp_init = f"tcp://127.0.0.1:{_free_port()}" if tp > 1 else ""
            for name in names:
                # The config (it can hold the API key and a store password) goes through a pipe:
                # it is never written to disk, so no killed launcher leaves it behind.
                read_end, write_end = os.pipe()
                try:
                    proc = subprocess.Popen(
                        child_command(name.split("-rank")[0], Path(f"/dev/fd/{read_end}")),
                        env=_child_env(name, self.cfg, tp_init),
                        pass_fds=(read_end,),
                    )
                finally:
                    os.close(read_end)
                threading.Thread(target=_feed, args=(write_end, config), name=f"config-{name}", daemon=True).start()
                self.children.append(Child(name, proc))
                self.log.info("started %s (pid %d)", name, proc.pid)
            code = self._wait_ready()
            if code is None:
                self._announce()
                code = self._supervise()
            return code
        finally:
            self._stop_all()
            self.control.close(0)
            self.ctx.term()
            if all(c.proc.poll() is not None for c in self.children):
                remove_runtime_files(self.cfg)
            self._lock.remove()

    def _poll_control(self, timeout_ms: int) -> Ready | Fatal | None:
        if not self.control.poll(timeout_ms):
            return None
        frames = self.control.recv_multipart()
        try:
            return self.decoder.decode(frames[0])
        except (msgspec.DecodeError, RecursionError) as e:
            self.log.warning("bad control message: %s", e)
            return None

    def _dead_child(self, wait_s: float = 0.0) -> Child | None:
        """A child that has exited, looking again for up to `wait_s` seconds; None if none has."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = next((c for c in self.children if c.proc.poll() is not None), None)
            if dead is not None or time.monotonic() >= deadline:
                return dead
            time.sleep(0.02)

    def _wait_ready(self) -> int | None:
        """None when every service is ready; an exit code when startup failed or was stopped."""
        pending = set(SERVICES)
        while pending:
            if self._signal is not None:
                self.log.info("interrupted during startup")
                return 0
            dead = self._dead_child()
            if dead is not None:
                self.log.error(
                    "service %s (pid %d) exited with code %s during startup",
                    dead.name,
                    dead.proc.pid,
                    dead.proc.returncode,
                )
                return 1
            msg = self._poll_control(100)
            if isinstance(msg, Ready):
                pending.discard(msg.service)
                self.log.info("%s ready%s", msg.service, f": {msg.detail}" if msg.detail else "")
            elif isinstance(msg, Fatal):
                self.log.error("service %s failed: %s", msg.service, msg.error)
                return 1
        return None

    def _announce(self) -> None:
        ep = self.cfg.endpoints.zmq_endpoint
        print(f"himamba is ready: model {self.cfg.model.model}; ZeroMQ clients connect to {ep}", flush=True)
        if self.cfg.http.port and self.cfg.endpoints.instance == f"port-{self.cfg.http.port}":
            find = f"--port {self.cfg.http.port}"
        else:
            find = f"--instance {self.cfg.endpoints.instance}"
        print(f'  try: himamba generate "def fibonacci(n):" {find}', flush=True)
        http = self.cfg.http
        if http.port:
            print(
                f"  OpenAI-compatible API at http://{http.host}:{http.port}/v1 (metrics at /metrics, health at /health)",
                flush=True,
            )
        print(f"  {storage_line(self.cfg)}", flush=True)

    def _supervise(self) -> int:
        while True:
            if self._signal is not None:
                self.log.info("received %s, shutting down", signal.Signals(self._signal).name)
                return 0
            dead = self._dead_child()
            if dead is not None:
                self.log.error(
                    "service %s (pid %d) died with exit code %s; stopping the server",
                    dead.name,
                    dead.proc.pid,
                    dead.proc.returncode,
                )
                return 1
            msg = self._poll_control(100)
            if isinstance(msg, Fatal):
                # A service that died first is the cause (a worker rank: rank 0's next collective fails).
                dead = self._dead_child(wait_s=CAUSE_GRACE_S)
                if dead is not None:
                    self.log.error(
                        "service %s (pid %d) died with exit code %s; stopping the server",
                        dead.name,
                        dead.proc.pid,
                        dead.proc.returncode,
                    )
                    return 1
                self.log.error("service %s reported a fatal error: %s; stopping the server", msg.service, msg.error)
                return 1

    def _stop_all(self) -> None:
        """Stop in dependency order: the front door first (it stops accepting and finishes or
        aborts what is in flight within --shutdown-timeout), then the back end together (their
        exits overlap). A service is killed only past its stage's grace; one line sums it up."""
        started = time.monotonic()
        # Asked to stop: SIGTERM, the services drain. A service died: SIGINT, they stop at once
        # (what is in flight cannot finish without it; clients get their 503 now).
        how = signal.SIGTERM if self._signal is not None else signal.SIGINT
        drain_s = self.cfg.http.shutdown_timeout_s if how == signal.SIGTERM else 0.0
        killed: list[str] = []
        # The back end's grace includes what the drain left of --shutdown-timeout: the cache flushes
        # pending backups in it.
        ranks = {c.name for c in self.children if c.name.startswith("worker-rank")}
        stages = ({"tokenizer"}, {"cache", "scheduler", "worker", *ranks})
        for stage in stages:
            grace = max(0.0, started + drain_s - time.monotonic()) + SERVICE_STOP_S
            live = [c for c in self.children if c.name in stage and c.proc.poll() is None]
            for c in live:
                if c.name in ranks:
                    continue  # rank 0 stops them through the group (or they see it break)
                try:
                    c.proc.send_signal(how)
                except ProcessLookupError:
                    pass
            stage_end = time.monotonic() + grace
            for c in live:
                try:
                    c.proc.wait(timeout=max(0.0, stage_end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self._kill(c)
                    killed.append(c.name)
        for c in self.children:
            if c.proc.poll() is None:
                self._kill(c)
                killed.append(c.name)
        if self.children:
            said = self._stop_summaries()
            self.log.info(
                "stopped in %.1fs: %s%s exited; killed: %s",
                time.monotonic() - started,
                "".join(f"{name}: {summary}; " for name, summary in said),
                ", ".join(f"{c.name} ({c.proc.returncode})" for c in self.children),
                ", ".join(killed) or "none",
            )

    def _stop_summaries(self) -> list[tuple[str, str]]:
        """What the services said their stop did (Stopped), in stop order: they are queued on the
        control socket by now (every service has exited)."""
        said: dict[str, str] = {}
        while (msg := self._poll_control(0)) is not None:
            if isinstance(msg, Stopped):
                said[msg.service] = msg.summary
        return [(name, said[name]) for name in ("tokenizer", "scheduler", "worker", "cache") if name in said]

    def _kill(self, c: Child) -> None:
        self.log.warning("%s (pid %d) did not stop in time; killing it", c.name, c.proc.pid)
        c.proc.kill()
        c.proc.wait()


def storage_line(cfg: Config) -> str:
    """The banner's line on the disk tier: off by default, so say how to turn it on."""
    cache = cfg.cache
    if not cache.enable_hierarchical_cache or cache.hicache_storage_backend == "none":
        return (
            "storage tier (disk) off: --hicache-storage-backend file (or --hicache-storage-dir DIR) keeps "
            "cached prefixes across restarts"
        )
    if cache.hicache_storage_backend == "file":
        from himamba.services.cache.storage.file import default_storage_dir

        where = cache.hicache_storage_dir or str(default_storage_dir())
        return f"storage tier on: file backend in {where}"
    return f"storage tier on: {cache.hicache_storage_backend} backend"


def _feed(fd: int, data: bytes) -> None:
    """Write a child's config into its pipe (a thread: a config larger than the pipe's buffer
    waits for the child to read)."""
    with os.fdopen(fd, "wb") as pipe:
        try:
            pipe.write(data)
        except BrokenPipeError:  # the child died before reading it: supervision reports that
            pass


def check_port_free(http: HttpConfig) -> None:
    """Raise ConfigError if the HTTP port cannot be bound (another server has it)."""
    if not http.port:
        return
    family = socket.AF_INET6 if ":" in http.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp binds it
        try:
            s.bind((http.host, http.port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(f"port: {http.host}:{http.port} is already in use: choose another --port") from None
            raise ConfigError(f"port: cannot bind {http.host}:{http.port}: {e.strerror}") from None


def _free_port() -> int:
    """A loopback TCP port free now, for the tensor-parallel group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env(name: str, cfg: Config, tp_init: str = "") -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONSAFEPATH"] = "1"
    if name.startswith("worker"):
        env[ENV_TP_RANK] = name.removeprefix("worker-rank") if name != "worker" else "0"
        env[ENV_TP_INIT] = tp_init
        name = "worker"
    # OpenMP threads that spin without bound make a step 10-30x slower whenever the cores are
    # shared (several services on one machine): every service sleeps at once, except the
    # worker's threads with a bounded spin (model.omp_spin); the user's own setting wins.
    worker_cpu = name == "worker" and cfg.model.device == "cpu"
    return openmp_wait_env(env, cfg.model.omp_spin if worker_cpu else 0)


def serve(cfg: Config) -> int:
    """Run a server on an already resolved config (endpoints and model)."""
    log = logging.getLogger("himamba.launch")
    return Launcher(cfg, log).run()
