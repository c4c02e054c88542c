"""`VLLMServer` (vLLM's own server as a bench peer) and the HTTP batch client: readiness, the binding
its log names, a batch timed through /v1/completions, a short completion and a failed start are errors,
and closing it leaves no process of its group behind. vLLM's module is replaced by a stand-in that
speaks the same HTTP (vLLM is not installed in CI)."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest

from himamba.bench.generate import PeerError
from himamba.bench.http_completions import CompletionError
from himamba.bench.vllm_server import VLLMServer

HERE = Path(__file__).parent


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) is gone for our purposes
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def _gone_within(pid: int, seconds: float) -> bool:
    """Whether pid has exited within `seconds` (a liveness bound: a killed process still takes its exit)."""
    deadline = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_batch_is_timed_and_closing_stops_the_whole_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(HERE))
    log = tmp_path / "vllm-server.log"
    server = VLLMServer(Path(sys.executable), tmp_path, "float32", 64, 2, log, module="openai_standin")
    try:
        assert server.model == "standin-model"
        assert server.binding() == "[0]"
        assert server.complete([[1, 2, 3], [4, 5]], 8) > 0
        with pytest.raises(CompletionError, match="returned 7 completion tokens, 8 were asked for"):
            server.complete([[1], [13]], 8)
        (helper,) = map(int, re.findall(r"helper pid=(\d+)", log.read_text()))
        assert _alive(helper)
    finally:
        server.close()
    assert server.proc.poll() is not None
    assert _gone_within(helper, 30.0)


def test_a_server_that_exits_at_start_is_an_error_naming_its_log(tmp_path: Path) -> None:
    with pytest.raises(PeerError, match="exited .* before it was ready(.|\n)*No module named"):
        VLLMServer(Path(sys.executable), tmp_path, "float32", 64, 2, tmp_path / "log", module="no_such_vllm_module")
