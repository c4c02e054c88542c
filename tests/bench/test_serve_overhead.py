"""`himamba bench serve-overhead` on a tiny checkpoint: the worker's step time is read from /metrics
and is part of each round's end-to-end time; transformers' generate runs the same requests beside it; the
requests also go through the OpenAI HTTP API; the table and the JSON carry every batch size."""

from __future__ import annotations

import io
import json
from argparse import Namespace
from pathlib import Path

from himamba.services.bench.serve_overhead import run
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
