"""`himamba bench serve-overhead` on a tiny checkpoint: the worker's step time is read from /metrics
and is part of each round's end-to-end time; transformers' generate runs the same requests beside it; the
requests also go through the OpenAI HTTP API; the table and the JSON carry every batch size."""

from __future__ import annotations

import io
import json
from argparse import Namespace
from pathlib import Path
from typing import Any

import pytest

from himamba.bench import serve_overhead
from himamba.bench.serve_overhead import run
from himamba.services.modelgen.checkpoint import make_checkpoint


def test_rounds_split_end_to_end_time_into_worker_and_server(tmp_path: Path) -> None:
    ckpt = make_checkpoint("nemotron_h", tmp_path / "ckpt", preset="tiny", seed=1)
    args = Namespace(
        arch="nemotron_h", preset="tiny", checkpoint=ckpt, seed=0, threads=1, prompt_len=16, new_tokens=8,
        batches=[1, 2], runs=1, out=str(tmp_path / "out"), reference=True, peer=[], peer_python=None, omp_spin=0,
    )  # fmt: skip
    out = io.StringIO()
    summary = run(args, out)
    assert [r["batch"] for r in summary["rows"]] == [1, 2]
    for row in summary["rows"]:
        (one,) = row["runs"]
        assert 0 < one["worker_s"] < one["e2e_s"]
        # the same requests went through the OpenAI HTTP API too
        assert one["http_s"] > 0
        assert row["server_ms_per_token"] == row["server_ms_per_token_min"] > 0
        # transformers' generate ran the same requests, right after ours
        assert one["transformers_s"] > 0
        assert row["transformers_speed_ratio"] == one["transformers_s"] / one["e2e_s"]
    assert json.loads((tmp_path / "out" / "serve_overhead.json").read_text())["rows"] == summary["rows"]
    assert "server ms/token" in out.getvalue() and "transformers" in out.getvalue()
    assert "over HTTP" in out.getvalue()


def test_each_round_starts_one_engine_later_after_the_same_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(serve_overhead, "_pause", lambda: calls.append("pause"))
    monkeypatch.setattr(serve_overhead, "_settled_step_seconds", lambda port: calls.append("pause") or 1.0)
    monkeypatch.setattr(serve_overhead, "_run_batch", lambda *a: calls.append("zmq") or 0.5)
    monkeypatch.setattr(serve_overhead, "complete_batch", lambda *a: calls.append("http") or 0.4)

    class Peer:
        def __init__(self, name: str) -> None:
            self.name = name

        def generate(self, prompts: list[list[int]], n: int) -> Any:
            calls.append(self.name)
            return Namespace(seconds=0.3)

        def complete(self, prompts: list[list[int]], n: int) -> float:
            calls.append(self.name)
            return 0.6

    firsts = []
    for rotation in range(5):
        calls.clear()
        measured = serve_overhead._round(rotation, [[1]], 2, "ep", 1, "http", "m", [Peer("vllm")], [Peer("srv")])  # type: ignore[list-item]
        ran = [c for c in calls if c != "pause"]
        firsts.append(ran[0])
        # every engine once, each right after a pause (ours over ZMQ: one more, to read the worker's time)
        assert sorted(ran) == ["http", "srv", "vllm", "zmq"]
        assert all(calls[calls.index(name) - 1] == "pause" for name in ran)
        assert measured == {"e2e_s": 0.5, "worker_s": 0.0, "http_s": 0.4, "vllm_s": 0.3, "srv_s": 0.6}
    assert firsts == ["zmq", "http", "vllm", "srv", "zmq"]
