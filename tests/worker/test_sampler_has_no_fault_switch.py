"""The production sampler has no fault-injection switch: the environment variable that once armed
a NaN hook in it changes nothing (tests inject faults from tests/hostile/fault_site instead)."""

from __future__ import annotations

import subprocess
import sys

_PROBE = """
import torch
from himamba.common.types import SamplingParams
from himamba.services.worker.sampler import sample
out = sample(torch.zeros(1, 8), [SamplingParams(temperature=0.0, seed=7)], [0])
print("errors", out.errors)
"""


def test_the_old_fault_variable_does_not_poison_sampling() -> None:
    env = {"HIMAMBA_FAULT_SAMPLER_NAN_SEED": "7", "PYTHONSAFEPATH": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "errors {}" in done.stdout, done.stdout
