"""The per-instance runtime directory: private, checked when it exists, locked while in use, and
the endpoints in it (never an abstract socket unless the operator says so)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from himamba.common.config import load
from himamba.common.runtime_dir import (
    InstanceLock,
    RuntimeDirError,
    client_endpoint,
    instance_name,
    resolve_endpoints,
    runtime_base,
)


@pytest.fixture(autouse=True)
def _private_base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))


def _cfg(port: int = 30000, **endpoints: object):
    return load(overrides={"http": {"port": port}, "endpoints": dict(endpoints)})


def test_the_instance_directory_is_private_and_holds_every_endpoint(tmp_path: Path) -> None:
    cfg = resolve_endpoints(_cfg())
    d = tmp_path / "himamba" / "port-30000"
    assert cfg.endpoints.instance == "port-30000"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700 and d.stat().st_uid == os.geteuid()
    eps = [cfg.endpoints.zmq_endpoint, cfg.endpoints.tokenizer_ipc, cfg.endpoints.scheduler_ipc,
           cfg.endpoints.worker_ipc, cfg.endpoints.cache_ipc, cfg.endpoints.control_ipc]  # fmt: skip
    assert len(set(eps)) == 6 and all(e.startswith(f"ipc://{d}/") for e in eps), eps
    assert client_endpoint(port=30000) == cfg.endpoints.zmq_endpoint
    # Another port is another instance: several servers per host with no other flag.
    assert resolve_endpoints(_cfg(30001)).endpoints.zmq_endpoint != cfg.endpoints.zmq_endpoint


def test_http_off_needs_an_instance_name() -> None:
    with pytest.raises(RuntimeDirError, match="--instance"):
        resolve_endpoints(_cfg(0))
    assert resolve_endpoints(_cfg(0, instance="blue")).endpoints.instance == "blue"
    for bad in ("../x", "a/b", ".hidden", "x" * 65):
        with pytest.raises(RuntimeDirError, match="instance"):
            instance_name(_cfg(0, instance=bad))


def test_a_directory_another_user_owns_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "himamba" / "port-30000"
    d.mkdir(parents=True, mode=0o700)
    os.chown(d, 65534, 65534)  # tests run as root; root may hand it to nobody
    with pytest.raises(RuntimeDirError, match="belongs to uid 65534"):
        resolve_endpoints(_cfg())


def test_a_base_another_user_owns_is_refused(tmp_path: Path) -> None:
    base = tmp_path / "himamba"
    base.mkdir(mode=0o755)
    os.chown(base, 65534, 65534)
    with pytest.raises(RuntimeDirError, match="belongs to uid 65534"):
        resolve_endpoints(_cfg())


def test_a_symlinked_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "himamba").mkdir(mode=0o700)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "himamba" / "port-30000").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(RuntimeDirError, match="symlink"):
        resolve_endpoints(_cfg())


def test_an_open_directory_of_ours_is_tightened(tmp_path: Path) -> None:
    d = tmp_path / "himamba" / "port-30000"
    d.mkdir(parents=True)
    d.chmod(0o777)
    resolve_endpoints(_cfg())
    assert stat.S_IMODE(d.stat().st_mode) == 0o700


def test_the_unix_socket_path_length_is_checked(tmp_path: Path) -> None:
    with pytest.raises(RuntimeDirError, match="bytes, more than"):
        resolve_endpoints(_cfg(runtime_dir=str(tmp_path / ("d" * 100))))


@pytest.mark.parametrize("endpoint", ["ipc://@himamba-worker", "tcp://0.0.0.0:5555"])
def test_endpoints_others_can_reach_need_the_insecure_mark(endpoint: str) -> None:
    with pytest.raises(RuntimeDirError, match="insecure_endpoints"):
        resolve_endpoints(_cfg(worker_ipc=endpoint))
    cfg = resolve_endpoints(_cfg(worker_ipc=endpoint, insecure_endpoints=True))
    assert cfg.endpoints.worker_ipc == endpoint


def test_a_second_lock_on_the_instance_is_a_one_line_error() -> None:
    cfg = resolve_endpoints(_cfg())
    lock = InstanceLock(cfg, "server")
    try:
        with pytest.raises(RuntimeDirError, match=f"already running \\(server, pid {os.getpid()}\\)"):
            InstanceLock(cfg, "server")
    finally:
        lock.release()
    InstanceLock(cfg, "server").release()  # free again once released


def test_the_base_follows_systemd_then_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert runtime_base() == tmp_path / "himamba"
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(tmp_path / "sd"))
    assert runtime_base() == tmp_path / "sd"
    assert runtime_base(str(tmp_path / "mine")) == tmp_path / "mine"


def test_serve_without_http_or_instance_is_one_line(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONSAFEPATH="1")
    out = subprocess.run(
        [sys.executable, "-P", "-m", "himamba.services.cli", "serve", "--port", "0", "--model", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0, out.stderr
    assert "--instance" in out.stderr
