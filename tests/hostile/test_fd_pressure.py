"""File-descriptor pressure cannot abort the front door. The server was started under
`prlimit --nofile=1024:4096`: it raises its soft limit, holds more idle connections than the
old soft limit, refuses (503, stated in the body) what is beyond its connection cap, keeps
ZeroMQ clients served meanwhile, and closes idle and slow-loris connections at the request
deadline."""

from __future__ import annotations

import json
import select
import socket
import time
from pathlib import Path

from himamba.common.client import Client
from tests.hostile.conftest import (
    API_KEY,
    HARD_LIMIT,
    MAX_CONNECTIONS,
    OLD_SOFT_LIMIT,
    REQUEST_TIMEOUT_S,
    Hostile,
    raise_own_fd_limit,
    soft_nofile,
    tokenizer_pid,
)


def _readable(socks: list[socket.socket]) -> list[socket.socket]:
    """The sockets the server has written to or closed (an idle, held one is neither)."""
    poller = select.poll()
    by_fd = {s.fileno(): s for s in socks}
    for fd in by_fd:
        poller.register(fd, select.POLLIN | select.POLLHUP)
    return [by_fd[fd] for fd, _ in poller.poll(0)]


def _closed_by_server(s: socket.socket) -> bool:
    try:
        return s.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def _http_get(port: int, path: str) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_many_idle_and_slow_connections_abort_nothing(hostile: Hostile) -> None:
    assert soft_nofile(tokenizer_pid(hostile.server.proc.pid)) == HARD_LIMIT  # raised from OLD_SOFT_LIMIT
    assert MAX_CONNECTIONS > OLD_SOFT_LIMIT
    raise_own_fd_limit(MAX_CONNECTIONS + 512)
    idle: list[socket.socket] = []
    try:
        # A slow-loris client: a request head that never completes, one byte at a time.
        loris = socket.create_connection(("127.0.0.1", hostile.port), timeout=30)
        idle.append(loris)
        loris.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        for _ in range(MAX_CONNECTIONS - 1):
            idle.append(socket.create_connection(("127.0.0.1", hostile.port), timeout=30))
        # The cap is full: one more connection is refused with the documented 503 ...
        status, body = _http_get(hostile.port, "/health")
        assert status == 503 and json.loads(body)["error"]["code"] == "too_many_connections", body
        # ... while every connection it holds (more than the old soft limit) is still open.
        assert _readable(idle) == []
        # ZeroMQ clients (new connections, the case that tripped a libzmq assert) are served.
        with Client(hostile.endpoint, timeout_s=120, api_key=API_KEY) as c:
            assert len(c.generate(input_ids=[5, 6, 7], max_tokens=3, ignore_eos=True).token_ids) == 3
        # The request deadline closes the idle connections and the slow-loris, however slowly it
        # keeps sending: their descriptors come back.
        deadline = time.monotonic() + REQUEST_TIMEOUT_S * 4 + 30  # a bound on the wait, not on the server
        sent = 0
        while time.monotonic() < deadline and len(_readable(idle)) < len(idle):
            if sent < 40 and not _closed_by_server(loris):
                try:
                    loris.send(b"X")
                    sent += 1
                except OSError:
                    pass
            time.sleep(0.5)
        assert all(_closed_by_server(s) for s in idle), sum(not _closed_by_server(s) for s in idle)
    finally:
        for s in idle:
            s.close()
    status, body = _http_get(hostile.port, "/health")
    assert status == 200, body
    assert hostile.alive()
    assert "Traceback" not in hostile.server.log()


def test_the_shipped_systemd_unit_sets_a_high_fd_limit() -> None:
    unit = (Path(__file__).parents[2] / "configs" / "systemd" / "himamba@.service").read_text()
    limits = [line.split("=", 1)[1] for line in unit.splitlines() if line.startswith("LimitNOFILE=")]
    assert limits and int(limits[0].split(":")[-1]) >= 65536, limits


def test_the_connection_cap_stays_below_the_fd_limit() -> None:
    import resource

    from himamba.services.tokenizer.http.connections import FD_RESERVE, connection_cap

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert connection_cap(0) == soft - FD_RESERVE
    assert connection_cap(10**9) == soft - FD_RESERVE  # an operator's cap above the limit is lowered
    assert connection_cap(100) == 100


def test_zmq_and_http_connection_caps_together_stay_below_the_fd_limit() -> None:
    import resource

    from himamba.services.tokenizer.http.connections import FD_RESERVE, client_connection_cap, connection_cap

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    zmq_cap = client_connection_cap(0)
    assert 0 < zmq_cap and zmq_cap + connection_cap(0, reserved=zmq_cap) == soft - FD_RESERVE
    assert client_connection_cap(10**9) == (soft - FD_RESERVE) // 2  # at most half: HTTP keeps the rest
