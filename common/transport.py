"""Async ZeroMQ sockets for the actors: one bound PULL inbox per service, PUSH outboxes to peers.

All sockets of a process share one zmq.asyncio context and run on the uvloop event loop.
`linger` is short so a process never hangs at exit on a peer that is gone.
"""

from __future__ import annotations

from typing import Any, Generic, Sequence, TypeVar

import torch
import zmq
import zmq.asyncio

from himamba.common.wire import Decoder, encode

T = TypeVar("T")

_LINGER_MS = 200


def new_context() -> zmq.asyncio.Context:
    return zmq.asyncio.Context()


class Inbox(Generic[T]):
    """The PULL socket a service binds; `recv()` returns (message, tensor frames)."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, type_: type[T]):
        self.endpoint = endpoint
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, _LINGER_MS)
        self.sock.bind(endpoint)
        self.decoder: Decoder[T] = Decoder(type_)

    async def recv(self) -> tuple[T, list[Any]]:
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

    async def send(self, msg: Any, tensors: Sequence[torch.Tensor] = ()) -> None:
        await self.sock.send_multipart(encode(msg, tensors), copy=False)

    def send_nowait(self, msg: Any, tensors: Sequence[torch.Tensor] = ()) -> None:
        """Queue a message without awaiting (used from signal handlers and at shutdown)."""
        self.sock.send_multipart(encode(msg, tensors), copy=False, flags=zmq.NOBLOCK)

    def close(self) -> None:
        self.sock.close(linger=_LINGER_MS)
