"""A TokenizerService (in a subprocess) with its HTTP server on a free port, a fake scheduler
answering it from a thread of the test process, and fake peers (worker / scheduler / cache)
that send it Ready and MetricsReport messages. Fast and deterministic: no model runs."""

from __future__ import annotations

import http.client
import json
import os
import socket
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
    AbortRequest,
    AddRequest,
    CacheStats,
    Message,
    Ready,
    TokenBatch,
    TokenOut,
    ToLauncher,
    ToScheduler,
)
from himamba.common.types import CachedTokens
from himamba.services.bench.servers import ServerProcess, start_server
from himamba.services.modelgen.tokenizer_files import build_demo_tokenizer

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FakeScheduler:
    """Answers AddRequests: prompts starting with "hold" get two tokens and never finish; any
    other prompt streams REPLY_TEXT's tokens (up to max_tokens) and finishes with "length"."""

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

    def _answer(self, req: AddRequest) -> None:
        prompt = self.tokenizer.decode(req.input_ids)
        hold = prompt.startswith("hold")
        ids = self.reply_ids[:2] if hold else self.reply_ids[: req.max_tokens]
        for i, t in enumerate(ids):
            last = i == len(ids) - 1 and not hold
            out = TokenOut(
                rid=req.rid,
                token_ids=[t],
                logprobs=[-0.5 - i] if req.sampling.logprobs else None,
                finish_reason="length" if last else None,
                prompt_tokens=len(req.input_ids),
                completion_tokens=i + 1,
                cached=CACHED if i == 0 else None,
            )
            self.out.send(self.encoder.encode(TokenBatch(outs=[out])))

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

    def adds(self) -> list[AddRequest]:
        with self._cond:
            return [m for m in self.received if isinstance(m, AddRequest)]

    def aborts_of(self, rid_suffix: str) -> list[AbortRequest]:
        with self._cond:
            return [m for m in self.received if isinstance(m, AbortRequest) and m.rid.endswith(rid_suffix)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.ctx.destroy(linger=0)


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


class HttpResult:
    def __init__(self, status: int, headers: dict[str, str], body: bytes):
        self.status = status
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        return json.loads(self.body)


class Harness:
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
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            return HttpResult(resp.status, dict(resp.getheaders()), resp.read())
        finally:
            conn.close()

    def post(self, path: str, body: Any = None, **kw: Any) -> HttpResult:
        return self.request("POST", path, body, **kw)

    def get(self, path: str, **kw: Any) -> HttpResult:
        return self.request("GET", path, **kw)


_SERVICE_MAIN = """
import sys
from himamba.common.config import decode
from himamba.services.tokenizer.service import TokenizerService
sys.exit(TokenizerService(decode(sys.argv[1].encode())).run())
"""


@pytest.fixture(scope="session")
def demo_tokenizer() -> Tokenizer:
    return build_demo_tokenizer()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer: Tokenizer) -> Path:
    out = tmp_path_factory.mktemp("model")
    demo_tokenizer.save(str(out / "tokenizer.json"))
    tok_cfg = {"eos_token": "<|endoftext|>", "bos_token": "<|system|>", "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    config = {"vocab_size": demo_tokenizer.get_vocab_size(with_added_tokens=True), "eos_token_id": 0}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def harness(model_dir: Path, demo_tokenizer: Tokenizer) -> Iterator[Harness]:
    tag = uuid.uuid4().hex[:12]
    eps = {
        n: f"ipc://@himamba-test-{tag}-{n}" for n in ("client", "tokenizer", "scheduler", "worker", "cache", "control")
    }
    cfg = config_mod.load(
        overrides={
            "model": {"model": str(model_dir), "max_context_len": MAX_CONTEXT_LEN, "served_model_name": MODEL_NAME},
            "scheduler": {"default_max_tokens": 32},
            "endpoints": {
                "zmq_endpoint": eps["client"],
                "tokenizer_ipc": eps["tokenizer"],
                "scheduler_ipc": eps["scheduler"],
                "worker_ipc": eps["worker"],
                "cache_ipc": eps["cache"],
                "control_ipc": eps["control"],
            },
            "log": {"level": "warning"},
            "http": {"port": free_port(), "api_key": API_KEY},
            "metrics": {"report_interval_s": REPORT_INTERVAL_S},
        }
    )
    ctx = zmq.Context()
    control = ctx.socket(zmq.PULL)
    control.bind(cfg.endpoints.control_ipc)
    scheduler = FakeScheduler(cfg, demo_tokenizer)
    peers = Peers(cfg)
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _SERVICE_MAIN, config_mod.encode(cfg).decode()], env=env)
    try:
        deadline = time.monotonic() + 60
        while not control.poll(200):
            if proc.poll() is not None:
                raise AssertionError(f"TokenizerService exited with {proc.returncode} before Ready")
            if time.monotonic() > deadline:
                raise AssertionError("TokenizerService did not report Ready")
        assert isinstance(msgspec.msgpack.decode(control.recv(), type=ToLauncher), Ready)
        yield Harness(cfg, scheduler, peers, demo_tokenizer, model_dir)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        peers.close()
        scheduler.close()
        ctx.destroy(linger=0)


# ---------------------------------------------------------------- a real server (himamba serve)

LIVE_API_KEY = "sk-himamba-test"


class LiveServer:
    """A `himamba serve` with unique endpoints and its HTTP port; stopped by PID."""

    def __init__(self, server: ServerProcess, port: int, api_key: str):
        self.server = server
        self.proc = server.proc
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.endpoint = server.endpoint  # ZeroMQ clients
        self.api_key = api_key
        self.log_path = server.log_path

    def log(self) -> str:
        return self.server.log()

    def cache_stats(self) -> CacheStats:
        return self.server.cache_stats()

    def get(self, path: str) -> HttpResult:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return HttpResult(resp.status, dict(resp.getheaders()), resp.read())
        finally:
            conn.close()

    def stop(self, timeout_s: float = 15.0) -> None:
        self.server.stop(timeout_s)


def start_live_server(model_dir: Path, log_dir: Path, *flags: str, api_key: str = "") -> LiveServer:
    """`himamba serve` on `model_dir` with unique ZeroMQ endpoints and a free HTTP port."""
    port = free_port()
    key_flags = ("--api-key", api_key) if api_key else ()
    server = start_server(model_dir, log_dir, "--port", str(port), *key_flags, *flags)
    return LiveServer(server, port, api_key)


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
