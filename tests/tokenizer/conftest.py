"""Shared fixtures: the demo tokenizer, a checkpoint dir, and a TokenizerService in a subprocess
talking to a fake scheduler that runs in a thread of the test process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from himamba.common.config import Config
from himamba.common.types import CachedTokens
from himamba.services.modelgen.tokenizer_files import build_demo_tokenizer
from tests.tokenizer.fakes import FakeScheduler, running_service, service_config, write_model_dir

# What the fake model "generates" for every prompt: multi-byte characters split across tokens.
REPLY_TEXT = "héllo wörld 日本語 🎉 done"
MAX_CONTEXT_LEN = 64
CACHED = CachedTokens(device=2, host=1, storage=0)


@pytest.fixture(scope="session")
def demo_tokenizer() -> Tokenizer:
    return build_demo_tokenizer()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer: Tokenizer) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("model"), demo_tokenizer, {"eos_token": "<|endoftext|>"})


class Server:
    """A running TokenizerService and its fake scheduler (and what the fake model answers)."""

    def __init__(self, cfg: Config, scheduler: FakeScheduler):
        self.cfg = cfg
        self.scheduler = scheduler
        self.endpoint = cfg.endpoints.zmq_endpoint
        self.tokenizer = scheduler.tokenizer
        self.reply_text = REPLY_TEXT
        self.reply_ids = scheduler.reply_ids
        self.cached = CACHED
        self.max_context_len = MAX_CONTEXT_LEN


@pytest.fixture(scope="session")
def server(model_dir: Path, demo_tokenizer: Tokenizer) -> Iterator[Server]:
    # ZeroMQ only here; tests/http covers the HTTP server
    cfg = service_config(model_dir, MAX_CONTEXT_LEN, http={"port": 0})
    scheduler = FakeScheduler(cfg, demo_tokenizer, REPLY_TEXT, CACHED)
    try:
        with running_service(cfg):
            yield Server(cfg, scheduler)
    finally:
        scheduler.close()
