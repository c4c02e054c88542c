"""One decode step of a small NemotronH (no MoE layers: those are their own work) on the CUDA code
path, run on CPU: the Triton twins under TRITON_INTERPRET=1 and every `cuda_path` branch forced.
The step (the model's forward and the sampler) makes no host sync but the one read of the sampled
ids, updates recurrent state in place (no gather/scatter of state rows), and launches exactly as
many kernels at batch 8 as at batch 1.

The step runs in a subprocess (`decode_launches_run.py`) so that this process never imports triton.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from himamba.kernels.dispatch import CUDA_PATH_ENV, KERNELS_ENV
from tests.worker.hf_reference import save_tiny

RUNNER = Path(__file__).resolve().parent / "decode_launches_run.py"
BATCHES = (1, 8)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.fixture(scope="module")
def counts(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("launches")
    # Every NemotronH layer kind but MoE: Mamba2, attention, MLP.
    model = save_tiny(
        "NemotronH",
        folder / "hf",
        layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention"],
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_INTERPRET": "1", KERNELS_ENV: "triton", CUDA_PATH_ENV: "1"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    out = folder / "counts.json"
    proc = subprocess.run(
        [sys.executable, str(RUNNER), str(model), str(out), ",".join(map(str, BATCHES))],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("batch", BATCHES)
def test_the_only_sync_is_the_read_of_the_sampled_ids(counts: dict, batch: int) -> None:
    syncs = counts[str(batch)]["syncs"]
    assert len(syncs) == 1, syncs
    op, where = syncs[0]
    assert op == "tolist" and where.startswith("sampler.py:"), syncs


@pytest.mark.parametrize("batch", BATCHES)
def test_the_step_runs_the_twins_on_the_pool_rows_in_place(counts: dict, batch: int) -> None:
    ops = counts[str(batch)]["ops"]
    # Two Mamba2 layers: each one conv update and one state update, on the pool by slot index.
    assert ops["triton:_conv_update_kernel"] == 2 and ops["triton:_state_update_kernel"] == 2, ops
    assert "triton:_copy_rows_kernel" not in ops and "index_copy" not in ops and "index_copy_" not in ops, ops


def test_launches_do_not_grow_with_the_batch(counts: dict) -> None:
    one, eight = (counts[str(b)] for b in BATCHES)
    assert eight["ops"] == one["ops"]
    assert eight["launches"] == one["launches"] > 0
