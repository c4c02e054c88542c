"""Start a real `himamba serve` (with its HTTP port) for a test module; stop it by PID."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class HttpResult:
    def __init__(self, status: int, headers: dict[str, str], body: bytes):
        self.status = status
        self.headers = headers
        self.body = body


# ---------------------------------------------------------------- a real server (himamba serve)


class LiveServer:
    """A `himamba serve` with unique endpoints and its HTTP port; stopped by PID."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, log_path: Path):
        self.proc = proc
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str) -> HttpResult:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return HttpResult(resp.status, dict(resp.getheaders()), resp.read())
        finally:
            conn.close()

    def post_json(self, path: str, body: Any) -> Any:
        """POST a JSON body; the decoded JSON answer (raises on a non-200 status)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        if resp.status != 200:
            raise AssertionError(f"{path} answered {resp.status}: {data[:500]!r}")
        return json.loads(data)

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start_live_server(model_dir: Path, log_dir: Path, *flags: str, ready_timeout_s: float = 180.0) -> LiveServer:
    """`himamba serve` on `model_dir` with unique ZeroMQ endpoints and a free HTTP port."""
    tag = uuid.uuid4().hex[:12]
    port = free_port()
    args = [sys.executable, "-P", "-m", "himamba.services.cli", "serve", "--model", str(model_dir)]
    args += ["--torch-threads", "1", "--port", str(port)]
    for name in ("zmq_endpoint", "tokenizer_ipc", "scheduler_ipc", "worker_ipc", "cache_ipc", "control_ipc"):
        args += ["--" + name.replace("_", "-"), f"ipc://@himamba-test-{tag}-{name}"]
    args += list(flags)
    log_path = log_dir / f"server-{tag}.log"
    with open(log_path, "wb") as log:
        env = dict(os.environ, PYTHONSAFEPATH="1")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = LiveServer(proc, port, log_path)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if "himamba is ready" in server.log():
            return server
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()[-4000:]}")
        time.sleep(0.2)
    server.stop()
    raise TimeoutError(f"server not ready in {ready_timeout_s}s:\n{server.log()[-4000:]}")


@pytest.fixture(scope="session")
def demo_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight NemotronH checkpoint (with tokenizer and chat template)."""
    from himamba.services.modelgen.checkpoint import make_checkpoint

    return make_checkpoint("nemotron_h", tmp_path_factory.mktemp("ckpt") / "nemotron-h-tiny", preset="tiny", seed=0)


@pytest.fixture(scope="session")
def start_live_server_fn() -> Callable[..., LiveServer]:
    """`start_live_server` for test modules (conftest modules are not importable)."""
    return start_live_server
