"""A prefill step on the CUDA code path (run on CPU: the Triton twins under TRITON_INTERPRET=1, every
`cuda_path` branch forced), counted by `himamba bench launches`: with two captures per sequence, it
makes no host sync but the read of the sampled ids, and 8 sequences launch what 1 does (one varlen
call per layer op, one page-table scatter).

The bench runs in a subprocess, so that this process never imports triton.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.mark.parametrize("arch", ["nemotron_h", "qwen3_next"])
def test_prefill_launches_do_not_grow_with_the_batch_and_never_wait(arch: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "himamba.bench.launches", "--arch", arch, "--batch", "1", "--prefill-seqs", "1,8",
         "--out", str(tmp_path)],
        env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    prefill = json.loads((tmp_path / "launches.json").read_text())["prefill"]
    for seqs in ("1", "8"):
        assert prefill[seqs]["syncs"] == 0, prefill
        assert prefill[seqs]["token_reads"] == 1, prefill
    assert prefill["8"]["launches"] <= 1.1 * prefill["1"]["launches"], prefill
