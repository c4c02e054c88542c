"""Plain HTTP calls to a server under test on this machine: a free port to give it, and one
request's status, headers and body."""

from __future__ import annotations

import http.client
import json
import socket
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class HttpResult:
    """One answer: status, headers and the raw body."""

    def __init__(self, status: int, headers: dict[str, str], body: bytes):
        self.status = status
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        return json.loads(self.body)


def http_request(
    port: int,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 30.0,
) -> HttpResult:
    """Send one request to 127.0.0.1:`port` on a fresh connection and read the whole answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return HttpResult(resp.status, dict(resp.getheaders()), resp.read())
    finally:
        conn.close()
