"""No other local user controls the server: its endpoints are unix sockets in a 0700 directory
(abstract sockets, as before, let any user send Shutdown to the worker or Fatal to the
launcher), and with --api-key the ZeroMQ client protocol needs the key too."""

from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path

import msgspec

from himamba.common.messages import Fatal, Shutdown
from himamba.common.wire import encode
from tests.hostile.conftest import Door, Hostile

NOBODY = 65534


def _as_nobody(paths: list[str], payloads: list[bytes]) -> dict[str, str]:
    """Fork a child that drops to uid/gid 65534 and tries to reach each socket path (and to
    send a payload through it); returns what each attempt raised ("connected" if none)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no zmq, only the kernel's answer
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            results: dict[str, str] = {}
            for path in paths:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.settimeout(2)
                    s.connect(path)
                    for p in payloads:
                        s.sendall(p)
                    results[path] = "connected"
                except OSError as e:
                    results[path] = type(e).__name__
                finally:
                    s.close()
            try:
                os.listdir(os.path.dirname(paths[0]))
                results["listdir"] = "listed"
            except OSError as e:
                results["listdir"] = type(e).__name__
            os.write(write_fd, json.dumps(results).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    data = b""
    while chunk := os.read(read_fd, 65536):
        data += chunk
    os.close(read_fd)
    os.waitpid(pid, 0)
    return json.loads(data)


def _zmtp_frames(msg: object) -> list[bytes]:
    """What a foreign process would push at an inbox: the raw message bytes (a real attacker
    would speak ZMTP; it never gets as far as a handshake)."""
    return [b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f", *encode(msg)]  # a ZMTP greeting, then the body


def test_other_users_cannot_reach_any_endpoint(hostile: Hostile) -> None:
    endpoints = hostile.server.endpoints
    paths = [ep.removeprefix("ipc://") for ep in endpoints.values()]
    assert all(ep.startswith("ipc:///") for ep in endpoints.values()), endpoints  # no abstract sockets
    directory = Path(paths[0]).parent
    st = directory.stat()
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    assert all(Path(p).is_socket() for p in paths), paths
    before = hostile.metrics()
    payloads = [b"".join(_zmtp_frames(Shutdown(reason="foreign"))), b"".join(_zmtp_frames(Fatal(service="worker", pid=1, error="spoofed")))]
    results = _as_nobody(paths, payloads)
    assert results == {**{p: "PermissionError" for p in paths}, "listdir": "PermissionError"}, results
    # Nothing arrived: the server is up, serves, and counted no request from the attempt.
    assert hostile.alive()
    after = hostile.metrics()
    finished = [line for line in before.splitlines() if line.startswith("himamba_request_finished_total")]
    assert finished == [line for line in after.splitlines() if line.startswith("himamba_request_finished_total")]
    d = Door(hostile.endpoint)
    try:
        d.still_serves()
    finally:
        d.close()


def test_zeromq_clients_need_the_api_key(hostile: Hostile) -> None:
    for key in ("", "wrong-key"):
        d = Door(hostile.endpoint, key=key)
        try:
            reply = d.refused([msgspec.msgpack.encode(d.request("k1"))], code=401)
            assert "api_key" in reply.message and reply.rid == "k1"
        finally:
            d.close()
    d = Door(hostile.endpoint)
    try:
        d.still_serves()
    finally:
        d.close()
