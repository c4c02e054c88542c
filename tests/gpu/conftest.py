"""The device the GPU check's tests run on: `HIMAMBA_TEST_DEVICE` (cuda, or cpu for the check's CPU
rehearsal), else cuda where there is one; the whole folder is skipped where neither applies.
`HIMAMBA_CHECK_SIZE=tiny` shrinks every shape (the rehearsal runs the Triton twins under the interpreter)."""

from __future__ import annotations

import os

import pytest
import torch


def check_device() -> torch.device | None:
    """The device named by HIMAMBA_TEST_DEVICE, else cuda when one is present, else None."""
    name = os.environ.get("HIMAMBA_TEST_DEVICE")
    if name:
        return torch.device(name)
    return torch.device("cuda") if torch.cuda.is_available() else None


def tiny() -> bool:
    """Rehearsal sizes (HIMAMBA_CHECK_SIZE=tiny) instead of serving shapes."""
    return os.environ.get("HIMAMBA_CHECK_SIZE", "full") == "tiny"


@pytest.fixture(scope="session")
def device() -> torch.device:
    d = check_device()
    if d is None:
        pytest.skip("the GPU check's tests: no CUDA device (HIMAMBA_TEST_DEVICE=cpu rehearses them on the CPU)")
    return d
