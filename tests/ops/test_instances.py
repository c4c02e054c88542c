"""Several servers per host by default: two `himamba serve` that differ only in `--port` start
together on a fresh machine (neither has built the demo model yet: one builds it, the other
waits for it), each serves its own clients, and a third on a taken port or instance is a
one-line error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from himamba.common.client import Client
from tests.http_request import free_port


def _serve(env: dict[str, str], log: Path, *flags: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-P", "-m", "himamba.services.cli", "serve", *flags]
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_ready(proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while "himamba is ready" not in log.read_text(errors="replace"):
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
        time.sleep(0.2)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_two_servers_differing_only_in_port(tmp_path: Path) -> None:
    home = tmp_path / "home"  # a fresh machine: no demo model, no runtime directory
    env = dict(
        os.environ, HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), XDG_RUNTIME_DIR=str(tmp_path / "run"),
        PYTHONSAFEPATH="1", OMP_NUM_THREADS="1",
    )  # fmt: skip
    env.pop("RUNTIME_DIRECTORY", None)
    (tmp_path / "run").mkdir(mode=0o700)
    ports = [free_port(), free_port()]
    procs = [_serve(env, tmp_path / f"s{i}.log", "--port", str(p)) for i, p in enumerate(ports)]
    try:
        for i, proc in enumerate(procs):
            _wait_ready(proc, tmp_path / f"s{i}.log")
        logs = [(tmp_path / f"s{i}.log").read_text() for i in range(2)]
        assert sum("building the demo checkpoint" in text for text in logs) == 1, logs  # built once
        for p in ports:
            os.environ["XDG_RUNTIME_DIR"], saved = str(tmp_path / "run"), os.environ.get("XDG_RUNTIME_DIR")
            try:
                with Client(port=p, timeout_s=120) as c:
                    assert f"port-{p}" in c.endpoint
                    assert len(c.generate("hello", max_tokens=3, ignore_eos=True).token_ids) == 3
            finally:
                if saved is None:
                    os.environ.pop("XDG_RUNTIME_DIR")
                else:
                    os.environ["XDG_RUNTIME_DIR"] = saved
        # A taken instance (same port) and a port another program holds: one line each.
        for flags, needle in ((["--port", str(ports[0])], "already running"),
                              (["--port", str(ports[1]), "--instance", "other"], "already in use")):  # fmt: skip
            out = subprocess.run(
                [sys.executable, "-P", "-m", "himamba.services.cli", "serve", *flags],
                env=env, capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
            assert out.returncode == 2 and needle in out.stderr and out.stderr.strip().count("\n") == 0, out.stderr
        assert all(p.poll() is None for p in procs)
    finally:
        for proc in procs:
            _stop(proc)
