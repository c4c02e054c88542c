"""A module-scoped factory of real `himamba serve` processes, each stopped by PID at the end."""

from __future__ import annotations

import pytest

from himamba.services.bench.servers import ServerProcess, start_server


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory):
    started: list[ServerProcess] = []
    log_dir = tmp_path_factory.mktemp("logs")

    def start(model_dir, *flags, **kw) -> ServerProcess:
        s = start_server(model_dir, log_dir, *flags, **kw)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()
