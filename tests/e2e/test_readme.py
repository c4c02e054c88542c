"""The README's first commands work as written: `himamba serve` (embedded demo defaults) and
`himamba generate` in a second shell."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from himamba.bench.servers import himamba_command


def test_serve_then_generate_as_in_the_readme(tmp_path):
    env = dict(os.environ, PYTHONSAFEPATH="1")
    log = open(tmp_path / "serve.log", "wb")
    serve = subprocess.Popen([*himamba_command(), "serve"], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while "himamba is ready" not in (tmp_path / "serve.log").read_text(errors="replace"):
            assert serve.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "the demo server did not become ready"
            time.sleep(0.2)
        out = subprocess.run(
            [*himamba_command(), "generate", "def fibonacci(n):", "--max-tokens", "32"],
            capture_output=True, text=True, env=env, timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip()  # random weights: some text, whatever it is
        assert "completion 32 tokens" in out.stderr or "32" in out.stderr
        assert "RANDOM WEIGHTS" in (tmp_path / "serve.log").read_text(errors="replace")
    finally:
        os.killpg(serve.pid, signal.SIGTERM)
        try:
            serve.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
