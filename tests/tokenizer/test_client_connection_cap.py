"""The client socket's connection cap: a connection beyond it is shut down at once, served
clients are untouched, and a connection whose DISCONNECTED the monitor lost (it drops events
under a flood) is not counted forever."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import zmq
import zmq.asyncio

from himamba.services.tokenizer.client_socket import ClientMessage, ClientSocket


def test_the_newest_connection_beyond_the_cap_is_closed_and_lost_events_are_pruned(tmp_path: Path) -> None:
    path = tmp_path / "c.sock"

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        cs = ClientSocket(ctx, f"ipc://{path}", max_connections=2)
        with open(tmp_path / "not-a-connection", "w") as stale:
            cs._live[stale.fileno()] = None  # counted, but its DISCONNECTED never came
            dealers = []
            try:
                for i in range(2):
                    d = ctx.socket(zmq.DEALER)
                    d.setsockopt(zmq.LINGER, 0)
                    d.connect(f"ipc://{path}")
                    await d.send(b"hello %d" % i)
                    dealers.append(d)
                    got = await asyncio.wait_for(cs.recv(), 10)
                    assert isinstance(got, ClientMessage) and got.frames[0].bytes == b"hello %d" % i
                assert stale.fileno() not in cs._live and cs.connections == 2 and cs.refused == 0
                bare = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                bare.connect(str(path))
                bare.settimeout(10)
                try:
                    await asyncio.wait_for(cs.recv(), 1)  # drains the monitor: ACCEPTED, over the cap
                except TimeoutError:
                    pass
                assert cs.refused == 1
                data = b""
                while chunk := bare.recv(4096):  # the greeting may come first; then the end
                    data += chunk
                bare.close()
                for i, d in enumerate(dealers):  # the served clients are still served
                    await d.send(b"again %d" % i)
                    got = await asyncio.wait_for(cs.recv(), 10)
                    while not isinstance(got, ClientMessage):
                        got = await asyncio.wait_for(cs.recv(), 10)
                    assert got.frames[0].bytes == b"again %d" % i
            finally:
                for d in dealers:
                    d.close(0)
                cs.close()
                ctx.term()

    asyncio.run(scenario())
