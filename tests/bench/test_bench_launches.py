"""`himamba bench launches`: a decode step on the CUDA code path (run on CPU under the Triton
interpreter) launches the same kernels at batch 4 as at batch 1 and at 8 routed experts as at 4, and
makes the host wait only for the sampled ids."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def _run(tmp_path, *args: str) -> dict:
    out = tmp_path / "_".join(a.strip("-") for a in args)
    r = subprocess.run(
        [sys.executable, "-P", "-m", "himamba.services.cli", "bench", "launches", *args, "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads((out / "launches.json").read_text())


def test_decode_launches_do_not_grow_with_batch_or_experts(tmp_path):
    # The tiny NemotronH has every layer kind, a MoE layer among them.
    few = _run(tmp_path, "--arch", "nemotron_h", "--batch", "1,4", "--prefill-seqs", "1", "--experts", "4")
    many = _run(tmp_path, "--arch", "nemotron_h", "--batch", "1", "--prefill-seqs", "1", "--experts", "8")
    assert few["arch"] == "nemotron_h" and few["experts"] == 4 and set(few["decode"]) == {"1", "4"}
    for step in (few["decode"]["1"], few["decode"]["4"], many["decode"]["1"]):
        assert step["syncs"] == 0 and step["token_reads"] == 1, step
    assert few["decode"]["4"]["launches"] == few["decode"]["1"]["launches"]
    assert many["decode"]["1"]["launches"] == few["decode"]["1"]["launches"]
    assert few["prefill"]["1"]["launches"] > 0 and few["prefill"]["1"]["token_reads"] == 1


def test_bad_arguments_are_refused_before_anything_runs(tmp_path):
    r = subprocess.run(
        [sys.executable, "-P", "-m", "himamba.services.cli", "bench", "launches", "--arch", "mamba2", "--experts", "8"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode != 0 and "--experts applies to the MoE families" in r.stderr
