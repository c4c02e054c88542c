"""Start a real `himamba serve` (with its HTTP port) for a test module; stop it by PID."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.live_server import LiveServer, start_live_server


@pytest.fixture(scope="session")
def demo_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight NemotronH checkpoint (with tokenizer and chat template)."""
    from himamba.services.modelgen.checkpoint import make_checkpoint

    return make_checkpoint("nemotron_h", tmp_path_factory.mktemp("ckpt") / "nemotron-h-tiny", preset="tiny", seed=0)


@pytest.fixture(scope="session")
def start_live_server_fn() -> Callable[..., LiveServer]:
    """`start_live_server` for test modules, keeping them free of imports of test helpers."""
    return start_live_server
