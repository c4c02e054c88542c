"""A tcp:// client endpoint is CURVE-encrypted with an allow-list of client keys: a listed client
is served; a plain client, or one whose key is not listed, never gets past the handshake."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import zmq.auth

from himamba.bench.servers import start_server
from himamba.common.client import Client, CurveKeys
from himamba.services.modelgen.checkpoint import make_checkpoint
from tests.http_request import free_port
from tests.system_packages import UTIL_LINUX, skip_without


def test_curve_client_endpoint_serves_only_listed_clients(tmp_path: Path) -> None:
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    keys.mkdir()
    allowed.mkdir()
    _, server_secret = zmq.auth.create_certificates(str(keys), "server")
    client_public, client_secret = zmq.auth.create_certificates(str(keys), "client")
    _, stranger_secret = zmq.auth.create_certificates(str(keys), "stranger")
    Path(client_public).rename(allowed / "client.key")
    model = make_checkpoint("nemotron_h", tmp_path / "model", preset="tiny", seed=0)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    server = start_server(
        model, tmp_path / "logs", "--instance", f"curve-test-{os.getpid()}", "--zmq-endpoint", endpoint,
        "--curve-secret-key-file", server_secret, "--curve-clients-dir", str(allowed),
        "--hicache-storage-backend", "none",
    )  # fmt: skip
    try:
        assert server.endpoint == endpoint
        server_public = str(keys / "server.key")
        with Client(endpoint, timeout_s=60, curve=CurveKeys(server_public, client_secret)) as c:
            assert c.wait_connected(10)
            assert len(c.generate(input_ids=[5, 6, 7], max_tokens=3, ignore_eos=True).token_ids) == 3
        with Client(endpoint, timeout_s=5) as c:
            assert not c.wait_connected(2), "a plain client got through"
        with Client(endpoint, timeout_s=5, curve=CurveKeys(server_public, stranger_secret)) as c:
            assert not c.wait_connected(2), "a client whose key is not listed got through"
        assert server.proc.poll() is None
    finally:
        server.stop()


def test_tcp_without_curve_or_the_insecure_mark_is_refused(tmp_path: Path) -> None:
    from himamba.common.config import load
    from himamba.common.runtime_dir import RuntimeDirError, resolve_endpoints

    cfg = load(overrides={"endpoints": {"instance": "x", "runtime_dir": str(tmp_path), "zmq_endpoint": "tcp://0.0.0.0:5555"}})
    with pytest.raises(RuntimeDirError, match="curve_secret_key_file"):
        resolve_endpoints(cfg)


def test_unauthenticated_tcp_floods_cannot_exhaust_the_servers_descriptors(tmp_path: Path) -> None:
    # Turn 3's N3: 4,159 plain TCP connects with no handshake (and no key) made the front door
    # fail on EMFILE and the server stop. Beyond the cap the newest are shut down; the others
    # are closed when they do not finish the handshake in time.
    import socket
    import time

    from tests.hostile.conftest import raise_own_fd_limit

    skip_without(UTIL_LINUX)  # the server runs under prlimit
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    keys.mkdir()
    allowed.mkdir()
    _, server_secret = zmq.auth.create_certificates(str(keys), "server")
    client_public, client_secret = zmq.auth.create_certificates(str(keys), "client")
    Path(client_public).rename(allowed / "client.key")
    model = make_checkpoint("nemotron_h", tmp_path / "model", preset="tiny", seed=0)
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    server = start_server(
        model, tmp_path / "logs", "--instance", f"curve-flood-{os.getpid()}", "--zmq-endpoint", endpoint,
        "--curve-secret-key-file", server_secret, "--curve-clients-dir", str(allowed),
        "--hicache-storage-backend", "none", wrapper=("prlimit", "--nofile=1024:4096"),
    )  # fmt: skip
    flood: list[socket.socket] = []
    try:
        creds = CurveKeys(str(keys / "server.key"), client_secret)
        with Client(endpoint, timeout_s=60, curve=creds) as served:
            assert served.wait_connected(10)
            raise_own_fd_limit(5000)
            for _ in range(4200):
                try:
                    flood.append(socket.create_connection(("127.0.0.1", port), timeout=30))
                except OSError:  # the listen backlog is full for a moment
                    pass
            assert server.proc.poll() is None, server.log()[-3000:]
            # A client that was connected before the flood is still served.
            assert len(served.generate(input_ids=[5, 6, 7], max_tokens=3, ignore_eos=True).token_ids) == 3
            deadline = time.monotonic() + 120  # a bound on the wait, not on the server
            open_ = list(flood)
            while open_ and time.monotonic() < deadline:
                open_ = [s for s in open_ if not _closed_by_server(s)]
                time.sleep(0.5)
            assert not open_, f"{len(open_)} connections without a handshake stayed open"
        with Client(endpoint, timeout_s=60, curve=creds) as c:  # and a new one too
            assert len(c.generate(input_ids=[5, 6, 7], max_tokens=3, ignore_eos=True).token_ids) == 3
        assert server.proc.poll() is None
        assert "Too many open files" not in server.log()
    finally:
        for s in flood:
            s.close()
        server.stop()


def _closed_by_server(s) -> bool:
    import socket

    try:
        while s.recv(4096, socket.MSG_DONTWAIT):
            pass
        return True
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
