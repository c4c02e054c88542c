"""Actor base: one process, one uvloop event loop, one typed inbox, handlers per message.

A service subclasses `Actor`, implements `start()` (load what it owns), `handle(msg, frames)`
and optionally `background()` (a long-running loop such as the scheduler's). The base sends
`Ready` to the launcher once `start()` returns, stops on `Shutdown` or SIGTERM/SIGINT, and
reports `Fatal` (then exits non-zero) when anything escapes a handler's own error handling.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sys
import traceback
from typing import Any, Generic, TypeVar

import uvloop

from himamba.common.config import Config
from himamba.common.log import setup_logging
from himamba.common.messages import Fatal, Ready, Shutdown
from himamba.common.transport import Inbox, Outbox, new_context

M = TypeVar("M")

_PR_SET_PDEATHSIG = 1


def die_with_parent(how: signal.Signals = signal.SIGTERM) -> None:
    """Ask Linux to signal (SIGTERM) this process when its parent dies, so no orphan survives `serve`."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, how)
    except OSError:
        pass


class Actor(Generic[M]):
    """Base of the four services. `name` is used in logs, Ready and Fatal."""

    name: str = "actor"

    def __init__(self, cfg: Config, inbox_endpoint: str, inbox_type: type[M]):
        self.cfg = cfg
        self.log = setup_logging(self.name, cfg.log.level)
        self.ctx = new_context()
        self._inbox_endpoint = inbox_endpoint
        self._inbox_type = inbox_type
        self.inbox: Inbox[M] | None = None
        self.control = Outbox(self.ctx, cfg.endpoints.control_ipc)
        self._stopping: asyncio.Event | None = None  # created inside the loop
        self._exit_code = 0
        self._draining = False
        self._tasks: list[asyncio.Task[Any]] = []

    # ------------------------------------------------------------ for subclasses

    async def start(self) -> str:
        """Load what this service owns; return a short detail string for the Ready message."""
        return ""

    async def handle(self, msg: M, frames: list[Any]) -> None:
        raise NotImplementedError

    async def background(self) -> None:
        """A long-running loop beside the inbox (optional)."""
        return None

    async def stop(self) -> None:
        """Release resources before exit (optional)."""
        return None

    async def drain(self, timeout_s: float) -> None:
        """On SIGTERM, before stopping: finish in-flight work within `timeout_s` (optional)."""
        return None

    drain_timeout_s: float = 2.0

    # ------------------------------------------------------------ machinery

    def run(self) -> int:
        """Run the actor to completion; returns the process exit code."""
        return uvloop.run(self._main())

    def request_stop(self, reason: str = "") -> None:
        if self._stopping is not None and not self._stopping.is_set():
            self.log.info("stopping%s", f": {reason}" if reason else "")
            self._stopping.set()

    def _on_sigterm(self) -> None:
        if self._draining or self._stopping is None or self._stopping.is_set():
            self.request_stop("signal SIGTERM")
            return
        self._draining = True
        asyncio.get_running_loop().create_task(self._graceful_stop())

    async def _graceful_stop(self) -> None:
        try:
            await asyncio.wait_for(self.drain(self.drain_timeout_s), self.drain_timeout_s + 0.5)
        except Exception as e:  # a timeout or a failing drain still ends in a stop
            self.log.warning("drain did not complete: %r", e)
        self.request_stop("signal SIGTERM")

    def spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        """Start a task whose unexpected failure is fatal for the service (never silently gone)."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        task.add_done_callback(self._task_done)
        self._tasks.append(task)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._fatal(f"task {task.get_name()} failed: {exc!r}", exc)

    def _fatal(self, error: str, exc: BaseException | None = None) -> None:
        if exc is not None:
            self.log.error("%s\n%s", error, "".join(traceback.format_exception(exc)))
        else:
            self.log.error("%s", error)
        try:
            self.control.send_nowait(Fatal(service=self.name, pid=os.getpid(), error=error))
        except Exception:  # the launcher may be gone already
            pass
        self._exit_code = 1
        self.request_stop("fatal error")

    async def _main(self) -> int:
        self._stopping = asyncio.Event()
        self._exit_code = 0
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, self.request_stop, "signal SIGINT")
        loop.add_signal_handler(signal.SIGTERM, self._on_sigterm)
        try:
            self.inbox = Inbox(self.ctx, self._inbox_endpoint, self._inbox_type)
            # A stop request during a long start (model load, waiting for a peer) must not wait for it.
            starting = asyncio.ensure_future(self.start())
            stopping = asyncio.ensure_future(self._stopping.wait())
            await asyncio.wait([starting, stopping], return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():
                starting.cancel()
                await asyncio.gather(starting, return_exceptions=True)
                self._close()
                return self._exit_code
            stopping.cancel()
            detail = starting.result()
        except Exception as e:
            self._fatal(f"{self.name} failed to start: {e!r}", e)
            await asyncio.sleep(0.3)  # let the Fatal report leave
            self._close()
            return 1
        await self.control.send(Ready(service=self.name, pid=os.getpid(), detail=detail))
        self.log.info("ready%s", f" ({detail})" if detail else "")
        self.spawn(self._recv_loop(), "inbox")
        self.spawn(self.background(), "background")
        await self._stopping.wait()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            await self.stop()
        except Exception as e:
            self.log.warning("error while stopping: %r", e)
        self._close()
        return self._exit_code

    def _close(self) -> None:
        if self.inbox is not None:
            self.inbox.close()
            self.inbox = None
        self.ctx.destroy(linger=200)

    async def _recv_loop(self) -> None:
        assert self.inbox is not None
        while True:
            try:
                msg, frames = await self.inbox.recv()
            except ValueError as e:  # WireError: a peer sent garbage; report and go on
                self.log.warning("dropped an undecodable message: %s", e)
                continue
            if isinstance(msg, Shutdown):
                self.request_stop(msg.reason or "shutdown message")
                return
            await self.handle(msg, frames)


def run_actor(actor: Actor[Any]) -> None:
    die_with_parent()
    code = actor.run()
    logging.shutdown()
    sys.exit(code)
