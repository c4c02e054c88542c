"""The Triton twins compiled and run on a GPU against their references on the same CUDA inputs
(the same cases the interpreter runs on CPU), and dispatch picking them for CUDA tensors.

Skipped without a CUDA device or without triton. float32 inputs use exact ("ieee") dots, so the
interpreter's tolerances hold; half-precision inputs use tf32 dots and their own tolerances.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from himamba.kernels import dispatch
from tests.kernels import triton_cases

# One module-level skip (not one per case) where there is no GPU to run on.
if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
    pytest.skip("needs a CUDA device and triton", allow_module_level=True)


@pytest.fixture(autouse=True)
def on_cuda():
    triton_cases.use_device("cuda")
    yield
    triton_cases.use_device("cpu")


@pytest.mark.parametrize("case", triton_cases.CASES, ids=[c.id for c in triton_cases.CASES])
def test_twin_matches_reference_on_cuda(case: triton_cases.Case) -> None:
    assert case.run() >= 1


def test_dispatch_picks_the_twin_for_cuda_tensors() -> None:
    dispatch.kernels_mode.cache_clear()
    assert dispatch.uses_triton(torch.zeros(1, device="cuda"))
    x, w = torch.randn(4, 64, device="cuda"), torch.randn(64, device="cuda")
    torch.testing.assert_close(dispatch.rms_norm(x, w, 1e-5), dispatch._norm.rms_norm(x, w, 1e-5))
