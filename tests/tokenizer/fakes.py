"""A TokenizerService under test without a model: a model dir holding only tokenizer files, the
service in a subprocess, and a fake scheduler answering it from a thread of the test process.
Shared by tests/tokenizer (ZeroMQ clients) and tests/http (the HTTP server)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import zmq
from tokenizers import Tokenizer

from himamba.bench.servers import unique_endpoints
from himamba.common import config as config_mod
from himamba.common.config import Config
from himamba.common.messages import (
    AbortRequest,
    AddRequest,
    Ready,
    TokenBatch,
    TokenOut,
    ToLauncher,
    ToScheduler,
)
from himamba.common.types import CachedTokens

# The service runs in a fresh interpreter (the test modules are not importable from a child).
_SERVICE_MAIN = """
import sys
from himamba.common.config import decode
from himamba.services.tokenizer.service import TokenizerService
sys.exit(TokenizerService(decode(sys.argv[1].encode())).run())
"""


def write_model_dir(out: Path, tokenizer: Tokenizer, tokenizer_config: dict[str, Any]) -> Path:
    """A checkpoint dir with `tokenizer` and the config files the service reads (no weights)."""
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    config = {"vocab_size": tokenizer.get_vocab_size(with_added_tokens=True), "eos_token_id": 0}
    (out / "config.json").write_text(json.dumps(config))
    return out


def service_config(model_dir: Path, max_context_len: int, **sections: dict[str, Any]) -> Config:
    """A config on `model_dir` with unique endpoints; `sections` add to (or override) its defaults."""
    overrides: dict[str, dict[str, Any]] = {
        "model": {"model": str(model_dir), "max_context_len": max_context_len},
        "scheduler": {"default_max_tokens": 32},
        "endpoints": unique_endpoints("himamba-test"),
        "log": {"level": "warning"},
    }
    for name, values in sections.items():
        overrides[name] = {**overrides.get(name, {}), **values}
    return config_mod.load(overrides=overrides)


@contextmanager
def running_service(cfg: Config, ready_timeout_s: float = 60.0) -> Iterator[subprocess.Popen[bytes]]:
    """A TokenizerService on `cfg` in a subprocess, from its Ready report until the block ends."""
    ctx = zmq.Context()
    control = ctx.socket(zmq.PULL)
    control.bind(cfg.endpoints.control_ipc)
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _SERVICE_MAIN, config_mod.encode(cfg).decode()], env=env)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not control.poll(200):
            if proc.poll() is not None:
                raise AssertionError(f"TokenizerService exited with {proc.returncode} before Ready")
            if time.monotonic() > deadline:
                raise AssertionError("TokenizerService did not report Ready")
        ready = msgspec.msgpack.decode(control.recv(), type=ToLauncher)
        assert isinstance(ready, Ready), ready
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        ctx.destroy(linger=0)


class FakeScheduler:
    """Answers AddRequests like a scheduler would, and records everything it receives.

    The decoded prompt picks the behaviour: "hold..." sends two tokens and never finishes,
    "error..." answers with TokenOut.error, "silent..." never answers (a prefill that does not
    end), a prompt holding a key of `replies` streams that reply's tokens and finishes with "stop"
    (an end of sequence), anything else streams `reply_text`'s tokens (one per TokenBatch, up to
    max_tokens) and finishes with "length". The first token carries `cached`; logprobs come when
    asked for.
    """

    def __init__(self, cfg: Config, tokenizer: Tokenizer, reply_text: str, cached: CachedTokens):
        self.tokenizer = tokenizer
        self.reply_ids = tokenizer.encode(reply_text).ids
        self.cached = cached
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(cfg.endpoints.scheduler_ipc)
        self.out = self.ctx.socket(zmq.PUSH)
        self.out.connect(cfg.endpoints.tokenizer_ipc)
        self.decoder = msgspec.msgpack.Decoder(ToScheduler)
        self.encoder = msgspec.msgpack.Encoder()
        self.received: list[Any] = []
        self.replies: dict[str, str] = {}  # prompt substring -> the model's scripted answer
        self.failing: list[str] = []  # prompt substrings answered with TokenOut.error, as "error..." is
        self.holding: list[str] = []  # prompt substrings held unfinished, as "hold..." is
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
        if prompt.startswith("error") or any(key in prompt for key in self.failing):
            self._send([TokenOut(rid=req.rid, token_ids=[], error="boom", prompt_tokens=n_prompt)])
            return
        hold = prompt.startswith("hold") or any(key in prompt for key in self.holding)
        ids = self.reply_ids[:2] if hold else self.reply_ids[: req.max_tokens]
        finish = "length"
        scripted = [text for key, text in self.replies.items() if key in prompt]
        if scripted and not hold:
            full = self.tokenizer.encode(scripted[0]).ids
            ids, finish = full[: req.max_tokens], "stop" if len(full) <= req.max_tokens else "length"
        for i, t in enumerate(ids):
            last = i == len(ids) - 1 and not hold
            out = TokenOut(
                rid=req.rid,
                token_ids=[t],
                logprobs=[-0.5 - i] if req.sampling.logprobs else None,
                finish_reason=finish if last else None,
                prompt_tokens=n_prompt,
                completion_tokens=i + 1,
                cached=self.cached if i == 0 else None,
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
        """The received messages of type `cls`, in arrival order."""
        with self._cond:
            return [m for m in self.received if isinstance(m, cls)]

    def adds(self) -> list[AddRequest]:
        """The AddRequests received so far."""
        return self.of_type(AddRequest)

    def aborts_of(self, rid_suffix: str) -> list[AbortRequest]:
        """The AbortRequests received for rids ending in `rid_suffix`."""
        return [m for m in self.of_type(AbortRequest) if m.rid.endswith(rid_suffix)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.ctx.destroy(linger=0)
