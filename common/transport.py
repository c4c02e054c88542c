"""Async ZeroMQ sockets for the actors: one bound PULL inbox per service, PUSH outboxes to peers.

All sockets of a process share one zmq.asyncio context and run on the uvloop event loop.
`linger` is short so a process never hangs at exit on a peer that is gone.
"""

from __future__ import annotations

from typing import Any, Generic, Sequence, TypeVar

import zmq
import zmq.asyncio

from himamba.common.wire import Decoder, Frame, encode

T = TypeVar("T")

_LINGER_MS = 200
# The largest frame an inbox accepts (a peer sending more is disconnected before decoding): far
# above any real message (a batch's logits, a transfer order), but bounded.
MAX_FRAME_BYTES = 1 << 30


def new_context() -> zmq.asyncio.Context:
    return zmq.asyncio.Context()


class Inbox(Generic[T]):
    """The PULL socket a service binds; `recv()` returns (message, tensor frames)."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, type_: type[T]):
        self.endpoint = endpoint
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, _LINGER_MS)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self.sock.bind(endpoint)
        self._direct = zmq.Socket.shadow(self.sock.underlying)  # the same socket, without asyncio
        self.decoder: Decoder[T] = Decoder(type_)

    async def recv(self) -> tuple[T, list[Any]]:
        try:
            # A message already queued is taken at once: pyzmq's asyncio path (a future, a loop
            # callback) costs more than the message on a busy step. One reader per inbox, so
            # order is kept.
            frames = self._direct.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            frames = await self.sock.recv_multipart(copy=False)
        return self.decoder.decode(frames)

    def close(self) -> None:
        self.sock.close(linger=0)


class Outbox:
    """A PUSH socket connected to a peer's inbox. Sends never block the loop for long:
    ZeroMQ queues messages until the peer is there."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str):
        self.endpoint = endpoint
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, _LINGER_MS)
        self.sock.connect(endpoint)
        self._direct = zmq.Socket.shadow(self.sock.underlying)  # the same socket, without asyncio
        self._waiting = 0  # sends queued on the asyncio path (a direct send must not overtake them)

    async def send(self, msg: Any, tensors: Sequence[Frame] = ()) -> None:
        frames = encode(msg, tensors)
        if not self._waiting:
            try:
                # Straight to ZeroMQ's queue when it has room (almost always): no future, no loop
                # callback on the step's critical path.
                self._direct.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
        self._waiting += 1
        try:
            await self.sock.send_multipart(frames, copy=False)
        finally:
            self._waiting -= 1

    def send_nowait(self, msg: Any, tensors: Sequence[Frame] = ()) -> None:
        """Queue a message without awaiting (used from signal handlers and at shutdown)."""
        self.sock.send_multipart(encode(msg, tensors), copy=False, flags=zmq.NOBLOCK)

    def close(self) -> None:
        self.sock.close(linger=_LINGER_MS)
