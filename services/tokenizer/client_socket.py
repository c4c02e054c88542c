"""The ROUTER socket clients talk to, with prompt notice of clients that went away.

Frames are `[identity, payload]` both ways. A vanished client is noticed two ways:
- ROUTER_MANDATORY makes a send to it fail (EHOSTUNREACH) instead of dropping silently;
- a socket monitor reports each DISCONNECTED connection by file descriptor, and every received
  message tells (ZMQ_SRCFD) which descriptor it came through, so a descriptor maps to a client.
  ZMQ_ROUTER_NOTIFY would say this directly, but it is a draft option that the libzmq bundled
  with pyzmq rejects (EINVAL), so it is not used.

A client that does not read: its send queue is bounded (SNDHWM) and sends never block (a full
queue would stall the whole front door on one reader); with ROUTER_MANDATORY a send to a full
queue fails with EAGAIN instead of being dropped silently mid-stream, and that client is then
treated as gone: its requests are aborted and their memory returned. Messages larger than
`max_message_bytes` make ZeroMQ disconnect the sender (ZMQ_MAXMSGSIZE), before any decoding.

Connections are capped, as HTTP ones are: libzmq has no per-listener limit, accepts every
connection it is offered, and asserts when `accept` fails with EMFILE on an ipc:// listener (a
flood of bare connects aborted the front door; on tcp:// the next descriptor anything else asked
for failed). The monitor reports each ACCEPTED connection with its descriptor; one beyond
`max_connections` is shut down at once (shutdown(2), not close: libzmq sees the end of the stream
and closes its own descriptor), so served clients are never touched, and the cap plus the HTTP
one stay below the fd limit. A connection that has not finished the ZeroMQ (and CURVE) handshake
within HANDSHAKE_MS is closed by libzmq, so unauthenticated connections cannot hold descriptors.

Descriptors are reused by the kernel. Monitor events are drained before each client message is
returned (libzmq emits a connection's DISCONNECTED before closing its descriptor), but a message
from a new owner of a descriptor has been seen before the old owner's DISCONNECTED: a client that
closed its socket then aborted the request of the next client to connect (`FdOwners` accounts for
that event instead).
"""

from __future__ import annotations

import collections
import logging
import socket
import time
from typing import Any, NamedTuple

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils.monitor import parse_monitor_message

_POLL_MS = 200
HANDSHAKE_MS = 5000  # a connection must finish the ZeroMQ (and CURVE) handshake within this
log = logging.getLogger("himamba.tokenizer")


class ClientMessage(NamedTuple):
    """A message from a client: its identity and the frames after it (normally one payload)."""

    identity: bytes
    frames: list[Any]


class CurveServer(NamedTuple):
    """CURVE for a tcp:// client endpoint: the server's key pair, and the clients it accepts
    (a ZAP allow-list of their public keys; any other client fails the handshake)."""

    secret_key_file: str
    clients_dir: str


def _start_curve(ctx: zmq.asyncio.Context, router: zmq.asyncio.Socket, curve: CurveServer) -> AsyncioAuthenticator:
    public, secret = zmq.auth.load_certificate(curve.secret_key_file)
    if secret is None:
        raise ValueError(f"{curve.secret_key_file} holds no secret key")
    auth = AsyncioAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=curve.clients_dir)
    router.curve_secretkey = secret
    router.curve_publickey = public
    router.curve_server = True
    return auth


class FdOwners:
    """Which client each connection descriptor belongs to, and who left when one disconnects.

    A message on descriptor `fd` from another identity than its recorded owner means the old
    owner's connection closed and the kernel gave its descriptor to a new one: the old owner is
    gone, and one DISCONNECTED event for `fd` (the old connection's, possibly still on its way) is
    owed and must not be charged to the new owner. The same holds for an owner forgotten because
    a send found it unreachable.
    """

    def __init__(self) -> None:
        self._owner: dict[int, bytes] = {}
        self._stale: collections.Counter[int] = collections.Counter()  # DISCONNECTEDs owed per fd

    def message(self, fd: int, identity: bytes) -> bytes | None:
        """A message from `identity` arrived on `fd`; returns the previous owner if it is gone."""
        previous = self._owner.get(fd)
        self._owner[fd] = identity
        if previous is None or previous == identity:
            return None
        self._stale[fd] += 1
        return previous

    def disconnected(self, fd: int) -> bytes | None:
        """`fd`'s connection closed; returns the client that left (None: unknown or already counted)."""
        if self._stale[fd]:
            self._stale[fd] -= 1
            if not self._stale[fd]:
                del self._stale[fd]
            return None
        return self._owner.pop(fd, None)

    def forget(self, identity: bytes) -> None:
        """`identity` was found unreachable: its descriptors' DISCONNECTEDs are owed."""
        for fd, owner in list(self._owner.items()):
            if owner == identity:
                del self._owner[fd]
                self._stale[fd] += 1


class ClientGone(NamedTuple):
    """A client's connection closed: its requests should be aborted."""

    identity: bytes


class ClientSocket:
    """A bound ROUTER on the actor's context; `recv()` yields messages and departures."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        max_message_bytes: int = 16 << 20,
        send_queue: int = 1 << 16,
        curve: CurveServer | None = None,
        max_connections: int = 1 << 20,
    ):
        self.endpoint = endpoint
        self.max_connections = max_connections
        self.refused = 0  # connections shut down because the cap was full
        self._live: dict[int, None] = {}  # descriptors of the open connections, oldest first
        self._pruned_at = 0.0
        self.router = ctx.socket(zmq.ROUTER)
        self._auth = None
        if curve is not None:
            self._auth = _start_curve(ctx, self.router, curve)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.SNDHWM, send_queue)
        self.router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self.router.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
        self.overflowed = 0  # clients dropped because they did not read their replies
        self.monitor = self.router.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.router.bind(endpoint)
        self._local = _local_address(self.router.getsockopt(zmq.LAST_ENDPOINT).decode())
        self._poller = zmq.asyncio.Poller()
        self._poller.register(self.router, zmq.POLLIN)
        self._poller.register(self.monitor, zmq.POLLIN)
        self._owners = FdOwners()
        self._gone: collections.deque[bytes] = collections.deque()

    async def recv(self) -> ClientMessage | ClientGone:
        """The next client message, or the next client that disconnected."""
        while True:
            await self._drain_monitor()
            if self._gone:
                return ClientGone(self._gone.popleft())
            try:
                frames = await self.router.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                # Bounded: ZeroMQ's descriptor is edge-triggered, and an edge consumed by a send on
                # this socket must not leave a waiting message unread until the next arrival.
                await self._poller.poll(timeout=_POLL_MS)
                continue
            identity = frames[0].bytes
            fd = _source_fd(frames[0])
            if fd is not None:
                left = self._owners.message(fd, identity)
                if left is not None:
                    self._gone.append(left)
            return ClientMessage(identity, list(frames[1:]))

    async def send(self, identity: bytes, payload: bytes) -> bool:
        """Send one reply without blocking; False when the client is gone or its queue is full
        (it does not read): the caller then ends its requests."""
        try:
            await self.router.send_multipart([identity, payload], copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.overflowed += 1
            return False
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self._owners.forget(identity)
            return False
        return True

    async def _drain_monitor(self) -> None:
        while True:
            try:
                raw = await self.monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(raw)
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._live[fd] = None
                if len(self._live) > self.max_connections:
                    self._prune()
                if len(self._live) > self.max_connections:
                    self._refuse(fd)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._live.pop(fd, None)
                owner = self._owners.disconnected(fd)
                if owner is not None:
                    self._gone.append(owner)

    @property
    def connections(self) -> int:
        """Open client connections (as the monitor has reported them so far)."""
        return len(self._live)

    def _prune(self) -> None:
        """Forget descriptors that are no longer connections of this listener: the monitor drops
        events when its queue is full (a flood), and a lost DISCONNECTED would count a closed
        connection forever. At most once a second (it looks at every counted descriptor)."""
        now = time.monotonic()
        if now - self._pruned_at < 1.0:
            return
        self._pruned_at = now
        for fd in [fd for fd in self._live if not self._is_ours(fd)]:
            del self._live[fd]

    def _is_ours(self, fd: int) -> bool:
        """Whether `fd` is (still) a connection accepted by this listener."""
        try:
            conn = socket.socket(fileno=fd)  # no new descriptor: a view of libzmq's
        except OSError:
            return False
        try:
            return _local_address_of(conn) == self._local
        except OSError:
            return False
        finally:
            conn.detach()

    def _refuse(self, fd: int) -> None:
        """Shut down the connection just accepted on `fd`: its DISCONNECTED follows. Only when
        `fd` is still a connection of this listener (libzmq may have closed it, and the kernel
        given the number to another file, since the event was sent)."""
        if not self._is_ours(fd):
            self._live.pop(fd, None)
            return
        conn = socket.socket(fileno=fd)
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            return
        finally:
            conn.detach()
        self.refused += 1
        if self.refused == 1 or self.refused % 1000 == 0:
            log.warning(
                "ZeroMQ client connection cap (%d) reached: closed %d new connection(s) so far",
                self.max_connections,
                self.refused,
            )

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
        try:
            self.router.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
        self.router.close(linger=0)


def _local_address(endpoint: str) -> Any:
    """What getsockname() returns on a connection accepted by the listener bound at `endpoint`."""
    transport, _, address = endpoint.partition("://")
    if transport == "ipc":
        return address
    return int(address.rsplit(":", 1)[1])  # tcp: the port (the host may be a wildcard)


def _local_address_of(conn: socket.socket) -> Any:
    name = conn.getsockname()
    if conn.family == socket.AF_UNIX:
        return name if isinstance(name, str) else name.decode(errors="replace")
    return name[1]


def _source_fd(frame: Any) -> int | None:
    try:
        return int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return None
