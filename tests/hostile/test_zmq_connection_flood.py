"""A flood of bare connections to the ZeroMQ client socket cannot abort the front door (turn 3's
N2: about 1,090 connects made libzmq assert on EMFILE in its ipc listener). The server holds at
most its ZeroMQ connection cap, shuts down the newest beyond it, and keeps serving the clients
it already had; connections that never finish the handshake are closed."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from himamba.common.client import Client
from tests.hostile.conftest import API_KEY, HARD_LIMIT, Door, Hostile, raise_own_fd_limit, soft_nofile, tokenizer_pid

FLOOD = HARD_LIMIT + 100  # more connections than the server has descriptors


def _closed_by_server(s: socket.socket) -> bool:
    """The server ended this connection (its greeting may come first)."""
    try:
        while chunk := s.recv(4096, socket.MSG_DONTWAIT):
            del chunk
        return True
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_a_flood_of_bare_zmq_connections_is_capped_and_served_clients_go_on(hostile: Hostile, door: Door) -> None:
    assert hostile.endpoint.startswith("ipc://")
    path = hostile.endpoint.removeprefix("ipc://")
    door.still_serves()  # a client connected before the flood
    tokenizer = tokenizer_pid(hostile.server.proc.pid)
    assert soft_nofile(tokenizer) == HARD_LIMIT
    raise_own_fd_limit(FLOOD + 512)
    flood: list[socket.socket] = []
    try:
        for _ in range(FLOOD):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(30)
            try:
                s.connect(path)
            except OSError:  # the listen backlog is full for a moment: the server is behind, not gone
                s.close()
                continue
            flood.append(s)
        assert hostile.alive(), hostile.server.log()[-3000:]
        door.still_serves()  # the flood touched no served client
        # The server shut down connections beyond its cap (and, after the handshake interval, the
        # rest, as none of them said anything): every one of them ends.
        deadline = time.monotonic() + 120  # a bound on the wait, not on the server
        while time.monotonic() < deadline and not all(_closed_by_server(s) for s in flood):
            time.sleep(0.5)
        assert all(_closed_by_server(s) for s in flood)
        assert len(list(Path(f"/proc/{tokenizer}/fd").iterdir())) < HARD_LIMIT // 2
    finally:
        for s in flood:
            s.close()
    assert hostile.alive()
    door.still_serves()
    with Client(hostile.endpoint, timeout_s=120, api_key=API_KEY) as c:  # a new client is served
        assert len(c.generate(input_ids=[5, 6, 7], max_tokens=3, ignore_eos=True).token_ids) == 3
    log = hostile.server.log()
    assert "ZeroMQ client connection cap" in log and "Too many open files" not in log
