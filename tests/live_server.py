"""A real `himamba serve` with its HTTP port, for tests: the bench's `start_server` (unique
endpoints, readiness, stop by process group) plus a free port and HTTP helpers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from himamba.bench.servers import ServerProcess, start_server
from himamba.common.messages import CacheStats
from tests.http_request import HttpResult, free_port, http_request


class LiveServer:
    """A `himamba serve` with unique endpoints and its HTTP port; stopped by PID."""

    def __init__(self, server: ServerProcess, port: int, api_key: str):
        self.server = server
        self.proc = server.proc
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.endpoint = server.endpoint  # ZeroMQ clients
        self.api_key = api_key
        self.log_path = server.log_path

    def log(self) -> str:
        return self.server.log()

    def cache_stats(self) -> CacheStats:
        return self.server.cache_stats()

    def get(self, path: str) -> HttpResult:
        return http_request(self.port, "GET", path)

    def post_json(self, path: str, body: Any) -> Any:
        """POST a JSON body; the decoded JSON answer (raises on a non-200 status)."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        r = http_request(self.port, "POST", path, json.dumps(body).encode(), headers, timeout_s=120)
        if r.status != 200:
            raise AssertionError(f"{path} answered {r.status}: {r.body[:500]!r}")
        return r.json()

    def stop(self, timeout_s: float = 15.0) -> None:
        self.server.stop(timeout_s)


def start_live_server(
    model_dir: Path, log_dir: Path, *flags: str, api_key: str = "", ready_timeout_s: float = 180.0
) -> LiveServer:
    """`himamba serve` on `model_dir` with unique ZeroMQ endpoints and a free HTTP port."""
    port = free_port()
    key_flags = ("--api-key", api_key) if api_key else ()
    server = start_server(
        model_dir, log_dir, "--port", str(port), *key_flags, *flags, ready_timeout_s=ready_timeout_s
    )
    return LiveServer(server, port, api_key)
