"""vLLM's own OpenAI server as a benchmark peer: `python -m vllm.entrypoints.openai.api_server` in the
peer's venv (`--peer-python`), run as its users run `vllm serve`, and timed through the same HTTP
client as our server (http_completions.py).

"As its users run it" means vLLM's defaults for everything that decides speed: its front end and
engine core in separate processes, its CPU thread binding ("auto": on a small machine it keeps a core
for the front end), its OpenMP settings. Only what the comparison needs is set: the checkpoint and
dtype, enforce_eager (as the bare-engine peer), prefix caching off (our server runs with the radix
cache off too), loopback, a context and batch big enough for the bench's requests, and a KV space
that fits (VLLM_CPU_KVCACHE_SPACE, unless the environment sets it). vLLM is never imported here.
The server runs in its own process group and is stopped by its PID; its log goes to `log_path`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from himamba.bench.generate import PeerError
from himamba.bench.http_completions import complete_batch, served_model
from himamba.bench.servers import free_port

_BINDING = re.compile(r"core ids=(\[[^\]]*\])")


class VLLMServer:
    """A running vLLM OpenAI server; `complete` times one batch of requests through it."""

    name = "vllm-server"

    def __init__(
        self,
        python: Path,
        model_dir: Path,
        dtype: str,
        max_model_len: int,
        max_num_seqs: int,
        log_path: Path,
        kv_cache_gib: int = 1,
        start_timeout_s: float = 600.0,
        module: str = "vllm.entrypoints.openai.api_server",
    ) -> None:
        """Start the server and wait until /health answers (its start takes a while: imports, load)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        cmd = [
            str(python), "-m", module, "--model", str(model_dir), "--dtype", dtype, "--enforce-eager",
            "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
            "--no-enable-prefix-caching", "--seed", "0", "--host", "127.0.0.1", "--port", str(self.port),
        ]  # fmt: skip
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        try:
            self._wait_ready(start_timeout_s)
            self.model = served_model(self.url)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PeerError(
                    f"vLLM's server exited ({self.proc.returncode}) before it was ready; its log ends:\n{self._tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise PeerError(f"vLLM's server was not ready within {timeout_s:.0f} s; its log ends:\n{self._tail()}")

    def _tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def binding(self) -> str:
        """The CPUs vLLM bound its engine's threads to, as its log says ("?" if it does not)."""
        found = _BINDING.findall(self.log_path.read_text(errors="replace")) if self.log_path.exists() else []
        return found[-1] if found else "?"

    def complete(self, prompts: list[list[int]], new_tokens: int) -> float:
        """Wall seconds for the batch, every prompt sent at once."""
        return complete_batch(self.url, self.model, prompts, new_tokens)

    def close(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:  # its engine core and helpers share the group: none may outlive the run
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
