"""One real `himamba serve` for the hostile-client tests, shared by their modules.

It runs as an attacker would find a production server: an API key, under `prlimit
--nofile=1024:4096` (a distribution's default soft limit; the server raises it), an HTTP
connection cap above the old soft limit, short request deadlines, and NaN logits injected for one
seed (which no honest request uses) by the test-only `fault_site/sitecustomize.py` on its PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from himamba.bench.servers import ServerProcess, start_server
from himamba.common.messages import ClientReply, ErrorReply, GenerateChunk
from himamba.services.modelgen.checkpoint import make_checkpoint
from tests.http_request import HttpResult, free_port, http_request
from tests.system_packages import UTIL_LINUX, skip_without

API_KEY = "hostile-test-key"
FAULT_SITE = Path(__file__).parent / "fault_site"  # its sitecustomize poisons rows seeded NAN_SEED
NAN_SEED = 424242  # as in fault_site/sitecustomize.py
MAX_CONTEXT_LEN = 1024
MAX_CONNECTIONS = 1100  # above the soft limit the server was started with (1024)
REQUEST_TIMEOUT_S = 10.0
OLD_SOFT_LIMIT, HARD_LIMIT = 1024, 4096
CLIENT_SEND_QUEUE = 512  # replies queued for a client that does not read (the default is far more)


@dataclass
class Hostile:
    server: ServerProcess
    port: int

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def alive(self) -> bool:
        return self.server.proc.poll() is None

    def post(self, path: str, body: Any, *, raw: bytes | None = None, key: str | None = API_KEY) -> HttpResult:
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        data = raw if raw is not None else json.dumps(body).encode()
        return http_request(self.port, "POST", path, data, headers, timeout_s=120)

    def metrics(self) -> str:
        return http_request(self.port, "GET", "/metrics").body.decode()


@pytest.fixture(scope="session")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hostile]:
    skip_without(UTIL_LINUX)
    tmp = tmp_path_factory.mktemp("hostile")
    model = make_checkpoint("nemotron_h", tmp / "model", preset="tiny", seed=0)
    port = free_port()
    server = start_server(
        model, tmp / "logs",
        "--port", str(port), "--api-key", API_KEY, "--max-context-len", str(MAX_CONTEXT_LEN),
        "--max-connections", str(MAX_CONNECTIONS), "--request-timeout-s", str(REQUEST_TIMEOUT_S),
        "--body-timeout-s", "5", "--hicache-storage-backend", "none", "--client-send-queue", str(CLIENT_SEND_QUEUE),
        wrapper=("prlimit", f"--nofile={OLD_SOFT_LIMIT}:{HARD_LIMIT}"),
        env={"PYTHONPATH": os.pathsep.join(p for p in (str(FAULT_SITE), os.environ.get("PYTHONPATH", "")) if p)},
    )  # fmt: skip
    try:
        yield Hostile(server, port)
    finally:
        server.stop()


class Door:
    """A raw DEALER on the server's client socket."""

    def __init__(self, endpoint: str, key: str = API_KEY):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.key = key
        self.decoder = msgspec.msgpack.Decoder(ClientReply)

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def recv(self, timeout_s: float = 30.0) -> ClientReply:
        assert self.sock.poll(int(timeout_s * 1000)), f"no reply within {timeout_s}s"
        return self.decoder.decode(self.sock.recv())

    def exchange(self, frames: list[bytes], timeout_s: float = 30.0) -> ClientReply:
        self.send(frames)
        return self.recv(timeout_s)

    def request(self, rid: str | None = None, **fields: Any) -> dict[str, Any]:
        req: dict[str, Any] = {
            "type": "GenerateRequest",
            "rid": rid or uuid.uuid4().hex,
            "input_ids": [11, 12, 13],
            "sampling": {"max_tokens": 2, "ignore_eos": True},
            "stream": False,
            "api_key": self.key,
        }
        req.update(fields)
        return req

    def still_serves(self) -> None:
        rid = uuid.uuid4().hex
        reply = self.exchange([msgspec.msgpack.encode(self.request(rid))])
        assert isinstance(reply, GenerateChunk) and reply.rid == rid, reply
        assert reply.finished and len(reply.token_ids) == 2, reply

    def refused(self, frames: list[bytes], code: int = 400) -> ErrorReply:
        reply = self.exchange(frames)
        assert isinstance(reply, ErrorReply), reply
        assert reply.code == code and reply.message, reply
        return reply

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def door(hostile: Hostile) -> Iterator[Door]:
    d = Door(hostile.endpoint)
    yield d
    d.close()


def tokenizer_pid(launcher_pid: int) -> int:
    """The tokenizer child of a `himamba serve` launcher."""
    children = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()
    for pid in children:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"tokenizer" in cmdline:
            return int(pid)
    raise AssertionError(f"no tokenizer among {children}")


def soft_nofile(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no 'Max open files' line")


def raise_own_fd_limit(need: int) -> None:
    """This test process needs `need` descriptors for its own connections."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"this test needs {need} file descriptors; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))



