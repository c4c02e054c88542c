"""Bounds on HTTP connections: how many, and how long one may take to send a request.

- **A cap** below the process's file-descriptor limit: every descriptor the server needs for
  itself (ZeroMQ sockets, shared memory, the model's files) stays available however many
  clients connect. A connection beyond the cap is answered at once with `503` (an OpenAI-style
  error body, `code: "too_many_connections"`) and closed.
- **A request deadline**: a connection must deliver a complete request head within
  `request_timeout_s` of connecting, and again of finishing its previous response, or it is
  closed. That is the idle keep-alive timeout and the slow-loris defence in one (aiohttp's
  keep-alive timer only runs between requests). The body has its own deadline
  (`read_body`), answered with 408.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from himamba.services.tokenizer.http.errors import ApiError

# Descriptors kept for the server itself when the cap is derived from the fd limit.
FD_RESERVE = 256
_MIN_CAP = 16
_REFUSED_LINGER_S = 1.0


def _fd_room() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(_MIN_CAP, soft - FD_RESERVE)


def client_connection_cap(configured: int) -> int:
    """ZeroMQ client connections at most: the configured cap, or a quarter of the fd limit less
    the reserve; never more than half of that (HTTP connections get the rest)."""
    room = _fd_room()
    return max(_MIN_CAP, min(configured, room // 2) if configured else room // 4)


def connection_cap(configured: int, reserved: int = 0) -> int:
    """The configured cap, or the soft fd limit less a reserve for the server's own files and the
    `reserved` descriptors of ZeroMQ clients; never more than that (past it, a ZeroMQ socket could
    not get a descriptor and libzmq aborts)."""
    room = max(_MIN_CAP, _fd_room() - reserved)
    return min(configured, room) if configured else room


def _refusal(status: int, reason: str, message: str, code: str) -> bytes:
    body = msgspec.json.encode(
        {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    )
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class ConnectionGuard:
    """Counts the HTTP server's connections, refuses those beyond `cap` and closes those that
    miss the request deadline. Attach it to the aiohttp Server; the middleware tells it when a
    request starts and ends (`request_started`, `request_done`)."""

    def __init__(self, cap: int, request_timeout_s: float, log: logging.Logger):
        self.cap = cap
        self.request_timeout_s = request_timeout_s
        self.log = log
        self.live: dict[RequestHandler, asyncio.TimerHandle | None] = {}
        self.refused = 0
        self.timed_out = 0
        self._refusal = _refusal(
            503,
            "Service Unavailable",
            f"too many connections (the server accepts {cap}): retry later",
            "too_many_connections",
        )

    def attach(self, server: web.Server) -> None:
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: RequestHandler, transport: asyncio.Transport) -> None:
            made(handler, transport)
            if len(self.live) >= self.cap:
                self.refused += 1
                if self.refused == 1 or self.refused % 1000 == 0:
                    self.log.warning("HTTP connection cap (%d) reached: refused %d connection(s) so far", self.cap, self.refused)
                self._refuse(handler, transport)
                return
            self.live[handler] = None
            self._arm(handler)

        def connection_lost(handler: RequestHandler, exc: BaseException | None = None) -> None:
            timer = self.live.pop(handler, None)
            if timer is not None:
                timer.cancel()
            lost(handler, exc)

        server.connection_made = connection_made  # type: ignore[method-assign]
        server.connection_lost = connection_lost  # type: ignore[method-assign]

    def _refuse(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        # The request the client sends meanwhile is read and dropped (aiohttp ignores data on a
        # connection being closed), then the connection closes: closing with that request
        # unread would reset the connection and lose the 503 on its way.
        handler._force_close = True
        transport.write(self._refusal)
        if transport.can_write_eof():
            transport.write_eof()
        asyncio.get_running_loop().call_later(_REFUSED_LINGER_S, transport.close)

    def _arm(self, handler: RequestHandler) -> None:
        old = self.live.get(handler)
        if old is not None:
            old.cancel()
        loop = asyncio.get_running_loop()
        self.live[handler] = loop.call_later(self.request_timeout_s, self._expire, handler)

    def _expire(self, handler: RequestHandler) -> None:
        if handler in self.live:
            self.live[handler] = None
            self.timed_out += 1
            handler.force_close()

    def request_started(self, handler: Any) -> None:
        """A request head arrived on `handler`'s connection: no deadline while it is served."""
        timer = self.live.get(handler)
        if timer is not None:
            timer.cancel()
            self.live[handler] = None

    def request_done(self, handler: Any) -> None:
        """Its response is written: the next request head is due within the deadline."""
        if handler in self.live:
            self._arm(handler)


class MalformedRequestFilter(logging.Filter):
    """aiohttp logs every request it cannot parse with a traceback at ERROR: a client could
    fill the log with them. They are answered 400 anyway; count them and log one line now and then."""

    def __init__(self, log: logging.Logger):
        super().__init__()
        self.log = log
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        self.count += 1
        if self.count == 1 or self.count % 1000 == 0:
            # aiohttp puts the reason on the lines after "400, message:": one line, bounded.
            why = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())[:300]
            self.log.warning("malformed HTTP request answered 400 (%d so far): %s", self.count, why or type(exc).__name__)
        return False


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The request body, or a 408 when it does not arrive within `timeout_s` (a 400 when its
    Content-Encoding does not decode)."""
    try:
        return await asyncio.wait_for(request.read(), timeout_s)
    except RequestPayloadError as e:  # e.g. a gzip body that does not decompress
        why = str(e).strip().splitlines()[-1].strip() if str(e).strip() else "the body could not be read"
        raise ApiError(400, f"request body: {why}", code="invalid_body") from None
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g}s", code="request_timeout") from None
