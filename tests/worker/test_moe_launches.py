"""The serving MoE layers of every MoE family, on the CUDA code path (the Triton twins under the
interpreter, on CPU tensors): no host sync, and as many launches with 64 experts as with 8 and
at 32 tokens as at 1; the same output as on the reference kernels.

Runs `moe_launch_run.py` in a subprocess so that this process never imports triton.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from himamba.kernels import dispatch

RUNNER = Path(__file__).resolve().parent / "moe_launch_run.py"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.fixture(scope="module")
def counts() -> dict:
    env = os.environ | {dispatch.KERNELS_ENV: "triton", "TRITON_INTERPRET": "1"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns about a default change otherwise
    proc = subprocess.run(
        [sys.executable, str(RUNNER)], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


FAMILIES = ("nemotron_h", "qwen3_next", "granite_hybrid", "jamba")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_moe_layer_never_syncs_and_launches_as_many_ops_at_any_size(counts: dict, family: str) -> None:
    cases = [c for c in counts["cases"] if c["family"] == family]
    assert len(cases) == 4  # 8 and 64 experts, 1 and 32 tokens
    for case in cases:
        assert case["syncs"] == [], case
        assert case["triton_launches"] == 3, case  # route, gate_up, down
        assert case["max_diff"] < 1e-4, case
    assert len({c["launches"] for c in cases}) == 1, cases


def test_the_counter_sees_the_expert_loop_it_replaced(counts: dict) -> None:
    few, many = counts["controls"]
    assert (few["experts"], many["experts"]) == (8, 64)
    assert "bincount" in few["syncs"] and "tolist" in few["syncs"]
    assert many["launches"] > few["launches"]
