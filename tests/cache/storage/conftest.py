"""Real store processes for the remote storage backends' tests: module-scoped factories that start
`redis-server` or a Mooncake Store (master + segment-owning client) on 127.0.0.1 with free ports,
and stop every process they started by PID when the module ends, passed or failed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from himamba.services.cache.storage.local_stores import LocalMooncake, LocalRedis
from tests.system_packages import REDIS, skip_without, skip_without_mooncake


@pytest.fixture(scope="module")
def redis_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., LocalRedis]]:
    """`start(maxmemory_bytes=..., policy=...)` -> a running LocalRedis."""
    skip_without(REDIS)
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
    skip_without_mooncake()
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
