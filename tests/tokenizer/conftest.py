"""Shared fixtures: the demo tokenizer, a checkpoint dir, and a TokenizerService in a subprocess
talking to a fake scheduler that runs in a thread of the test process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from tokenizers import Tokenizer

from himamba.common import config as config_mod
from himamba.common.config import Config
from himamba.common.messages import (
    AddRequest,
    Ready,
    TokenBatch,
    TokenOut,
    ToLauncher,
    ToScheduler,
)
from himamba.common.types import CachedTokens
from himamba.services.modelgen.tokenizer_files import build_demo_tokenizer

# What the fake model "generates" for every prompt: multi-byte characters split across tokens.
REPLY_TEXT = "héllo wörld 日本語 🎉 done"
MAX_CONTEXT_LEN = 64
CACHED = CachedTokens(device=2, host=1, storage=0)


@pytest.fixture(scope="session")
def demo_tokenizer() -> Tokenizer:
    return build_demo_tokenizer()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer: Tokenizer) -> Path:
    out = tmp_path_factory.mktemp("model")
    demo_tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    config = {"vocab_size": demo_tokenizer.get_vocab_size(with_added_tokens=True), "eos_token_id": 0}
    (out / "config.json").write_text(json.dumps(config))
    return out


class FakeScheduler:
    """Answers AddRequests like a scheduler would, and records everything it receives.

    The decoded prompt picks the behaviour: "hold..." sends two tokens and never finishes,
    "error..." answers with TokenOut.error, "silent..." never answers (a prefill that does not
    end), anything else streams REPLY_TEXT's tokens (one per TokenBatch, up to max_tokens) and
    finishes with "length".
    """

    def __init__(self, cfg: Config, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.reply_ids = tokenizer.encode(REPLY_TEXT).ids
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(cfg.endpoints.scheduler_ipc)
        self.out = self.ctx.socket(zmq.PUSH)
        self.out.connect(cfg.endpoints.tokenizer_ipc)
        self.decoder = msgspec.msgpack.Decoder(ToScheduler)
        self.encoder = msgspec.msgpack.Encoder()
        self.received: list[Any] = []
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _send(self, outs: list[TokenOut]) -> None:
        self.out.send(self.encoder.encode(TokenBatch(outs=outs)))

    def _answer(self, req: AddRequest) -> None:
        prompt = self.tokenizer.decode(req.input_ids)
        n_prompt = len(req.input_ids)
        if prompt.startswith("silent"):
            return
        if prompt.startswith("error"):
            self._send([TokenOut(rid=req.rid, token_ids=[], error="boom", prompt_tokens=n_prompt)])
            return
        ids = self.reply_ids[:2] if prompt.startswith("hold") else self.reply_ids[: req.max_tokens]
        for i, t in enumerate(ids):
            last = i == len(ids) - 1 and not prompt.startswith("hold")
            out = TokenOut(
                rid=req.rid,
                token_ids=[t],
                finish_reason="length" if last else None,
                prompt_tokens=n_prompt,
                completion_tokens=i + 1,
                cached=CACHED if i == 0 else None,
            )
            self._send([out])

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.inbox.poll(50):
                continue
            msg = self.decoder.decode(self.inbox.recv())
            with self._cond:
                self.received.append(msg)
                self._cond.notify_all()
            if isinstance(msg, AddRequest):
                self._answer(msg)

    def wait_for(self, pred: Callable[[Any], bool], timeout_s: float = 10.0) -> Any:
        """The first received message matching `pred` (waits for it)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for m in self.received:
                    if pred(m):
                        return m
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"fake scheduler never received the expected message: {self.received}")
                self._cond.wait(remaining)

    def wait_rid(self, cls: type, client_rid: str, timeout_s: float = 10.0) -> Any:
        """The first `cls` message about a client's rid (internal rids end in ':<client rid>')."""
        return self.wait_for(lambda m: isinstance(m, cls) and m.rid.endswith(":" + client_rid), timeout_s)

    def of_type(self, cls: type) -> list[Any]:
        with self._cond:
            return [m for m in self.received if isinstance(m, cls)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.ctx.destroy(linger=0)


# The service runs in a fresh interpreter (the test modules are not importable from a child).
_SERVICE_MAIN = """
import sys
from himamba.common.config import decode
from himamba.services.tokenizer.service import TokenizerService
sys.exit(TokenizerService(decode(sys.argv[1].encode())).run())
"""


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
    tag = uuid.uuid4().hex[:12]
    endpoints = {
        name: f"ipc://@himamba-test-{tag}-{name}"
        for name in ("client", "tokenizer", "scheduler", "worker", "cache", "control")
    }
    cfg = config_mod.load(
        overrides={
            "model": {"model": str(model_dir), "max_context_len": MAX_CONTEXT_LEN},
            "scheduler": {"default_max_tokens": 32},
            "endpoints": {
                "zmq_endpoint": endpoints["client"],
                "tokenizer_ipc": endpoints["tokenizer"],
                "scheduler_ipc": endpoints["scheduler"],
                "worker_ipc": endpoints["worker"],
                "cache_ipc": endpoints["cache"],
                "control_ipc": endpoints["control"],
            },
            "log": {"level": "warning"},
            "http": {"port": 0},  # ZeroMQ only here; tests/http covers the HTTP server
        }
    )
    ctx = zmq.Context()
    control = ctx.socket(zmq.PULL)
    control.bind(cfg.endpoints.control_ipc)
    scheduler = FakeScheduler(cfg, demo_tokenizer)
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _SERVICE_MAIN, config_mod.encode(cfg).decode()], env=env)
    try:
        deadline = time.monotonic() + 60
        while not control.poll(200):
            if proc.poll() is not None:
                raise AssertionError(f"TokenizerService exited with {proc.returncode} before Ready")
            if time.monotonic() > deadline:
                raise AssertionError("TokenizerService did not report Ready")
        ready = msgspec.msgpack.decode(control.recv(), type=ToLauncher)
        assert isinstance(ready, Ready), ready
        yield Server(cfg, scheduler)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        scheduler.close()
        ctx.destroy(linger=0)
