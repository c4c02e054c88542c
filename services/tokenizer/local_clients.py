"""In-process clients of the front door (the HTTP server): each is a reply queue under an identity.

An HTTP request gets its own identity, so it goes through exactly the path a ZeroMQ client's
request takes (request table, detokenizer, stop strings, aborts): replies to that identity land
in its queue instead of on the ROUTER socket, and closing it early is a client disconnect.
Identities start with a zero byte and are longer than the 5 bytes ZeroMQ generates; a ZeroMQ
peer cannot choose an identity starting with a zero byte, so the two never collide.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable

from himamba.common.messages import ClientReply

_PREFIX = b"\x00local-"


class LocalClients:
    """The reply queues of in-process clients, by identity."""

    def __init__(self) -> None:
        self._queues: dict[bytes, asyncio.Queue[ClientReply]] = {}
        self._ids = itertools.count(1)

    def open(self) -> tuple[bytes, asyncio.Queue[ClientReply]]:
        """A fresh identity and the queue its replies will arrive in."""
        identity = _PREFIX + str(next(self._ids)).encode()
        queue: asyncio.Queue[ClientReply] = asyncio.Queue()
        self._queues[identity] = queue
        return identity, queue

    def __contains__(self, identity: bytes) -> bool:
        return identity in self._queues

    def deliver(self, identity: bytes, reply: ClientReply) -> bool:
        """Queue `reply`; False when that client is closed (the caller treats it as gone)."""
        queue = self._queues.get(identity)
        if queue is None:
            return False
        queue.put_nowait(reply)
        return True

    def close(self, identity: bytes) -> bool:
        """Forget a client; True if it was open."""
        return self._queues.pop(identity, None) is not None

    def identities(self) -> list[bytes]:
        return list(self._queues)


def is_local(identity: bytes) -> bool:
    """Whether `identity` names an in-process client rather than a ZeroMQ peer."""
    return identity.startswith(_PREFIX)


class ReplyStream:
    """The replies of one in-process request, in order. `close()` before the end aborts it."""

    def __init__(
        self,
        identity: bytes,
        queue: asyncio.Queue[ClientReply],
        on_close: Callable[[bytes], Awaitable[None]],
    ):
        self.identity = identity
        self._queue = queue
        self._on_close = on_close
        self._closed = False

    def ready_nowait(self) -> ClientReply | None:
        """The next reply if one is already queued (an immediate refusal), without waiting."""
        try:
            return self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None

    async def next(self) -> ClientReply:
        return await self._queue.get()

    async def close(self) -> None:
        """Done with this request: forget it, aborting it everywhere if it has not finished."""
        if not self._closed:
            self._closed = True
            await self._on_close(self.identity)
