"""A TokenizerService (in a subprocess) with its HTTP server on a free port, a fake scheduler
answering it from a thread of the test process, and fake peers (worker / scheduler / cache)
that send it Ready and MetricsReport messages. Fast and deterministic: no model runs."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from tokenizers import Tokenizer

from himamba.common.config import Config
from himamba.common.messages import Message, Ready
from himamba.common.types import CachedTokens
from himamba.services.modelgen.tokenizer_files import build_demo_tokenizer
from tests.http_request import HttpResult, free_port, http_request
from tests.live_server import LiveServer, start_live_server
from tests.tokenizer.fakes import FakeScheduler, running_service, service_config, write_model_dir

REPLY_TEXT = "héllo wörld 日本語 done"
MAX_CONTEXT_LEN = 64
CACHED = CachedTokens(device=3, host=2, storage=1)
API_KEY = "test-key-123"
MODEL_NAME = "fake-model"
REPORT_INTERVAL_S = 0.1  # peers count as gone after max(1 s, 5 intervals) without a report
# bos_token and eos_token come from tokenizer_config.json, as with HF.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class Peers:
    """Sends messages to the tokenizer's inbox as the worker, scheduler or cache would."""

    def __init__(self, cfg: Config):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(cfg.endpoints.tokenizer_ipc)
        self.encoder = msgspec.msgpack.Encoder()

    def send(self, msg: Message) -> None:
        self.sock.send(self.encoder.encode(msg))

    def ready(self, service: str) -> None:
        self.send(Ready(service=service, pid=os.getpid()))

    def close(self) -> None:
        self.ctx.destroy(linger=0)


class Harness:
    """The running service's HTTP port, its fake scheduler and peers, and what the fake model answers."""

    def __init__(self, cfg: Config, scheduler: FakeScheduler, peers: Peers, tokenizer: Tokenizer, model_dir: Path):
        self.cfg = cfg
        self.port = cfg.http.port
        self.scheduler = scheduler
        self.peers = peers
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.api_key = API_KEY
        self.cached = CACHED
        self.max_context_len = MAX_CONTEXT_LEN
        self.model_name = MODEL_NAME
        self.reply_text = REPLY_TEXT

    def request(
        self, method: str, path: str, body: Any = None, *, key: str | None = API_KEY, raw: bytes | None = None
    ) -> HttpResult:
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        return http_request(self.port, method, path, data, headers)

    def post(self, path: str, body: Any = None, **kw: Any) -> HttpResult:
        return self.request("POST", path, body, **kw)

    def get(self, path: str, **kw: Any) -> HttpResult:
        return self.request("GET", path, **kw)


@pytest.fixture(scope="session")
def demo_tokenizer() -> Tokenizer:
    return build_demo_tokenizer()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer: Tokenizer) -> Path:
    tok_cfg = {"eos_token": "<|endoftext|>", "bos_token": "<|system|>", "chat_template": CHAT_TEMPLATE}
    return write_model_dir(tmp_path_factory.mktemp("model"), demo_tokenizer, tok_cfg)


@pytest.fixture(scope="module")
def harness(model_dir: Path, demo_tokenizer: Tokenizer) -> Iterator[Harness]:
    cfg = service_config(
        model_dir,
        MAX_CONTEXT_LEN,
        model={"served_model_name": MODEL_NAME},
        http={"port": free_port(), "api_key": API_KEY},
        metrics={"report_interval_s": REPORT_INTERVAL_S},
    )
    scheduler = FakeScheduler(cfg, demo_tokenizer, REPLY_TEXT, CACHED)
    peers = Peers(cfg)
    try:
        with running_service(cfg):
            yield Harness(cfg, scheduler, peers, demo_tokenizer, model_dir)
    finally:
        peers.close()
        scheduler.close()


# ---------------------------------------------------------------- a real server (himamba serve)

LIVE_API_KEY = "sk-himamba-test"


@pytest.fixture(scope="session")
def demo_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight NemotronH checkpoint (with tokenizer and chat template)."""
    from himamba.services.modelgen.checkpoint import make_checkpoint

    return make_checkpoint("nemotron_h", tmp_path_factory.mktemp("ckpt") / "nemotron-h-tiny", preset="tiny", seed=0)


@pytest.fixture(scope="session")
def live_server(demo_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One real server (random-weight NemotronH, API key `LiveServer.api_key`) shared by the
    modules that need a model: started on first use, stopped at the end of the session."""
    server = start_live_server(demo_checkpoint, tmp_path_factory.mktemp("logs"), api_key=LIVE_API_KEY)
    try:
        yield server
    finally:
        server.stop()
