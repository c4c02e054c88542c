"""The front door's side of /flush_cache: ask the cache controller (which owns the cache) to flush,
and wait for its `CacheFlushed`, which arrives on the tokenizer's own inbox.

A refusal because copies or storage jobs were in flight (`busy`) is retried for a few seconds:
those end by themselves right after a request. A refusal because requests hold the cache is
answered at once, as sglang does.
"""

from __future__ import annotations

import asyncio
import itertools
import time

from himamba.common.messages import CacheFlushed, FlushCache
from himamba.common.transport import Outbox

_BUSY_RETRY_S = 0.1


class CacheFlusher:
    """Sends `FlushCache` to the cache controller and matches each `CacheFlushed` to its caller."""

    def __init__(self, cache: Outbox, reply_to: str, busy_wait_s: float = 10.0, answer_timeout_s: float = 10.0):
        self._cache = cache
        self._reply_to = reply_to
        self._busy_wait_s = busy_wait_s
        self._answer_timeout_s = answer_timeout_s
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[CacheFlushed]] = {}

    async def flush(self) -> CacheFlushed:
        """Flush, retrying while only copies are in flight; TimeoutError when the cache controller
        does not answer (it is down or restarting)."""
        deadline = time.monotonic() + self._busy_wait_s
        while True:
            reply = await self._ask()
            if reply.ok or not reply.busy or time.monotonic() >= deadline:
                return reply
            await asyncio.sleep(_BUSY_RETRY_S)

    async def _ask(self) -> CacheFlushed:
        flush_id = next(self._ids)
        future: asyncio.Future[CacheFlushed] = asyncio.get_running_loop().create_future()
        self._waiting[flush_id] = future
        try:
            return await asyncio.wait_for(self._send_and_wait(flush_id, future), self._answer_timeout_s)
        finally:
            self._waiting.pop(flush_id, None)

    async def _send_and_wait(self, flush_id: int, future: asyncio.Future[CacheFlushed]) -> CacheFlushed:
        await self._cache.send(FlushCache(flush_id=flush_id, reply_to=self._reply_to))
        return await future

    def on_flushed(self, reply: CacheFlushed) -> None:
        """A `CacheFlushed` arrived: wake its caller (a late one, after a timeout, is dropped)."""
        future = self._waiting.pop(reply.flush_id, None)
        if future is not None and not future.done():
            future.set_result(reply)

    def close(self) -> None:
        self._cache.close()
