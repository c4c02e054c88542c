"""`himamba bench kernels`: refuses plainly without a GPU, and (tested under the interpreter at tiny
sizes, in a subprocess) runs every op of both implementations and reports how far apart they are."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from himamba.bench import kernels as bench_kernels


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_without_a_gpu_it_says_so_and_fails(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert bench_kernels.main(["--out", str(tmp_path / "b.json")]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()
    # No twin was imported. (triton itself may be in this process: transformers' modeling code, which
    # other test modules import, loads it through torch when it is installed.)
    assert not [name for name in sys.modules if name.startswith("himamba.kernels.triton.")]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_tiny_run_under_the_interpreter_covers_every_op(tmp_path) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_DEFAULT_FP_FUSION="1")
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "himamba.bench.kernels", "--tiny", "--repeats", "1", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert "not a GPU timing" in summary["machine"]
    ops = {row["op"] for row in summary["rows"]}
    assert ops == set(bench_kernels.OPS)
    for row in summary["rows"]:
        assert row["max_abs_diff"] < 1e-3, row
        assert row["reference_ms"] > 0 and row["triton_ms"] > 0
