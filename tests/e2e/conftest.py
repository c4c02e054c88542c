"""Module-scoped fixtures: a factory of real `himamba serve` processes (each stopped by PID at the
end), and the tiny random-weight NemotronH checkpoint they serve with its transformers reference."""

from __future__ import annotations

import os

import pytest

from himamba.bench.servers import ServerProcess, start_server
from himamba.services.modelgen.checkpoint import make_checkpoint
from tests.worker.hf_reference import load_reference


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory):
    started: list[ServerProcess] = []
    log_dir = tmp_path_factory.mktemp("logs")

    # The GPU check (scripts/gpu/check.sh) serves these modules' servers on its device.
    device = os.environ.get("HIMAMBA_TEST_DEVICE")

    def start(model_dir, *flags, **kw) -> ServerProcess:
        if device and "--device" not in flags:
            flags = (*flags, "--device", device)
        s = start_server(model_dir, log_dir, *flags, **kw)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random-weight NemotronH checkpoint, made once per module."""
    return make_checkpoint("nemotron_h", tmp_path_factory.mktemp("m"), preset="tiny")


@pytest.fixture(scope="module")
def ref(model_dir):
    """transformers' model of `model_dir`, for the greedy tokens outputs must equal."""
    return load_reference(model_dir)
