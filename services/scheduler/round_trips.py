"""Replies the scheduler awaits from the worker (BatchDone) and the cache controller
(CacheStepDone), keyed by the batch or step id they answer."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, Generic, TypeVar

from himamba.common.messages import BatchDone, CacheStepDone, Message
from himamba.common.transport import Outbox
from himamba.common.wire import Frame

R = TypeVar("R", BatchDone, CacheStepDone)


class WorkerRestarted(Exception):
    """An in-flight round trip that will never be answered: a peer restarted."""


class Reply(Generic[R]):
    """An awaited answer: `await reply.wait()` gives the message and its frames."""

    def __init__(self, fut: asyncio.Future[tuple[Any, list[Any]]], key: int = 0) -> None:
        self._fut = fut
        self.key = key  # the batch or step id it answers

    async def wait(self) -> tuple[R, list[Any]]:
        return await self._fut


class RoundTrips:
    """Ids for outgoing commands and the futures of their replies."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._replies: dict[int, asyncio.Future[tuple[Any, list[Any]]]] = {}

    def next_id(self) -> int:
        return next(self._ids)

    async def call(
        self, outbox: Outbox, msg: Message, key: int, reply_type: type[R], tensors: list[Frame] | None = None
    ) -> Reply[R]:
        """Send `msg` and return the reply to wait for (registered before the send)."""
        fut: asyncio.Future[tuple[Any, list[Any]]] = asyncio.get_running_loop().create_future()
        self._replies[key] = fut
        await outbox.send(msg, tensors or [])
        return Reply(fut, key)

    def resolve(self, key: int, msg: BatchDone | CacheStepDone, frames: list[Any]) -> None:
        fut = self._replies.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result((msg, frames))

    def fail_all(self) -> None:
        """Every awaited reply will never come (a peer restarted)."""
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(WorkerRestarted())
        self._replies.clear()
