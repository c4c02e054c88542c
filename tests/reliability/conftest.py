"""Servers for the reliability tests: real `himamba serve` processes (unique endpoints, stopped
by PID), started once per session and shared by the load, chaos and fuzz modules.

- `served.main`: the server under test: radix cache, host tier and (where the server has one)
  file storage in a fresh directory; device pools small enough that the load evicts and
  queues; HTTP on a free port.
- `served.reference`: the same model with no prefix cache: the greedy tokens every answer of
  the server under test must equal.

- `expendable`: small servers that tests may take down (kill -9, a message that crashes one).

`HIMAMBA_SOAK=1` makes the load, chaos and fuzz modules run far longer (see `soak_scale` and
the fuzz modules' settings) and enables test_soak.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pytest

from himamba.bench.servers import ServerProcess, himamba_command, start_server
from himamba.common.client import AsyncClient
from himamba.services.modelgen.checkpoint import make_checkpoint
from tests.reliability.prompts import MAX_CONTEXT_LEN
from tests.reliability.server_group import start_together

STORAGE_FLAG = "--hicache-storage-backend"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Served:
    main: ServerProcess
    reference: ServerProcess
    http_port: int
    main_storage_dir: Path | None  # the main server's file storage (None: no storage tier)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


class SoakScale(NamedTuple):
    """How much work each module does: small in CI, large under HIMAMBA_SOAK=1."""

    soak: bool
    load_rounds: int  # requests per load client
    chaos_waves: int


@pytest.fixture(scope="session")
def soak_scale() -> SoakScale:
    if os.environ.get("HIMAMBA_SOAK") == "1":
        return SoakScale(True, 40, 20)
    return SoakScale(False, 4, 1)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("nemotron_h", tmp_path_factory.mktemp("model") / "tiny", preset="tiny", seed=0)


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


MAIN_FLAGS = (
    "--max-total-tokens", "8192", "--max-mamba-cache-size", "48",
    "--hicache-tokens", "16384", "--hicache-mamba-slots", "96",
    "--max-context-len", str(MAX_CONTEXT_LEN),
)  # fmt: skip
REFERENCE_FLAGS = (
    "--disable-radix-cache", "--max-total-tokens", "32768", "--max-mamba-cache-size", "160",
    "--max-context-len", str(MAX_CONTEXT_LEN),
)  # fmt: skip


@pytest.fixture(scope="session")
def has_storage_tier() -> bool:
    return storage_tier_available()


@pytest.fixture(scope="session")
def storage_off(has_storage_tier: bool) -> tuple[str, ...]:
    """Flags that keep a server off the storage tier (which may be on by default, in the
    user's cache dir: tests must not share state through it)."""
    return (STORAGE_FLAG, "none") if has_storage_tier else ()


@pytest.fixture(scope="session")
def served(
    tiny_model: Path, server_logs: Path, tmp_path_factory: pytest.TempPathFactory, has_storage_tier: bool,
    storage_off: tuple[str, ...],
) -> Iterator[Served]:  # fmt: skip
    port = free_port()
    # The server under test uses every tier it has; its storage starts empty.
    storage_dir = tmp_path_factory.mktemp("storage") if has_storage_tier else None
    storage = (STORAGE_FLAG, "file", "--hicache-storage-dir", str(storage_dir)) if storage_dir else ()
    main_flags = (*MAIN_FLAGS, "--port", str(port), *storage)
    main, reference = start_together(tiny_model, server_logs, [main_flags, (*REFERENCE_FLAGS, *storage_off)])
    try:
        yield Served(main, reference, port, storage_dir)
    finally:
        main.stop()
        reference.stop()


EXPENDABLE = ("utf8", "tokenizer", "scheduler", "worker", "cache")


@pytest.fixture(scope="session")
def expendable(tiny_model: Path, server_logs: Path, storage_off: tuple[str, ...]) -> Iterator[dict[str, ServerProcess]]:
    """Small no-cache servers that tests may kill, started together on first use: "utf8" for
    a message that (while its bug lasts) takes a server down, and one per service for kill -9."""
    flags = ("--disable-radix-cache", "--max-total-tokens", "4096", "--max-mamba-cache-size", "8", *storage_off)
    servers = start_together(tiny_model, server_logs, [flags] * len(EXPENDABLE))
    try:
        yield dict(zip(EXPENDABLE, servers, strict=True))
    finally:
        for s in servers:
            s.stop()


ReferenceFn = Callable[[Sequence[tuple[list[int], int]]], list[list[int]]]


@pytest.fixture(scope="session")
def reference_tokens(served: Served) -> ReferenceFn:
    """Greedy tokens of (input_ids, max_tokens) requests on the no-cache reference server."""
    memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    async def run(todo: list[tuple[list[int], int]]) -> None:
        async with AsyncClient(served.reference.endpoint, timeout_s=120) as c:
            outs = await asyncio.gather(*(c.generate(input_ids=ids, max_tokens=n, ignore_eos=True) for ids, n in todo))
        for (ids, n), out in zip(todo, outs, strict=True):
            memo[(tuple(ids), n)] = out.token_ids

    def tokens(requests: Sequence[tuple[list[int], int]]) -> list[list[int]]:
        todo = list({(tuple(ids), n): (list(ids), n) for ids, n in requests if (tuple(ids), n) not in memo}.values())
        if todo:
            asyncio.run(run(todo))
        return [memo[(tuple(ids), n)] for ids, n in requests]

    return tokens


# ---------------------------------------------------------------- storage-tier chaos (hooks)


def storage_tier_available() -> bool:
    env = dict(os.environ, PYTHONSAFEPATH="1")
    out = subprocess.run([*himamba_command(), "serve", "--help"], capture_output=True, text=True, env=env, timeout=120, check=False)
    return STORAGE_FLAG in out.stdout


@pytest.fixture(scope="session")
def storage_server_factory(
    tiny_model: Path, server_logs: Path, has_storage_tier: bool
) -> Iterator[Callable[..., ServerProcess]]:
    """Start servers with the file storage backend in a given directory. Servers are stopped at
    the end of the session."""
    assert has_storage_tier, f"`himamba serve --help` lists no {STORAGE_FLAG}: the storage tier is gone"
    started: list[ServerProcess] = []

    def start(storage_dir: Path, *flags: str) -> ServerProcess:
        s = start_server(
            tiny_model, server_logs, STORAGE_FLAG, "file", "--hicache-storage-dir", str(storage_dir),
            "--max-context-len", str(MAX_CONTEXT_LEN), *flags,
        )  # fmt: skip
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()
