"""Real store processes for the remote storage backends' tests: module-scoped factories that start
`redis-server` or a Mooncake Store (master + segment-owning client) on 127.0.0.1 with free ports,
and stop every process they started by PID when the module ends, passed or failed."""

from __future__ import annotations

import importlib
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from himamba.services.cache.storage.local_stores import LocalMooncake, LocalRedis


@pytest.fixture(scope="module")
def redis_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., LocalRedis]]:
    """`start(maxmemory_bytes=..., policy=...)` -> a running LocalRedis."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run does it)")
    started: list[LocalRedis] = []

    def start(**kw: Any) -> LocalRedis:
        server = LocalRedis(tmp_path_factory.mktemp("redis"), **kw)
        started.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="module")
def mooncake_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., LocalMooncake]]:
    """`start(segment_bytes=..., lease_ttl_ms=..., run=True)` -> a LocalMooncake (running unless
    `run=False`)."""
    try:
        importlib.import_module("mooncake.store")
    except ImportError as e:
        pytest.skip(f"the Mooncake wheel is not usable ({e}); .ci/run installs it and its Debian libraries")
    started: list[LocalMooncake] = []

    def start(*, run: bool = True, **kw: Any) -> LocalMooncake:
        store = LocalMooncake(tmp_path_factory.mktemp("mooncake"), **kw)
        started.append(store)
        return store.start() if run else store

    try:
        yield start
    finally:
        for store in started:
            store.stop()
