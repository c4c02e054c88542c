"""Which code path a process takes: HIMAMBA_KERNELS (the implementation choice, read once) and
`cuda_path` (whether code that differs between CPU and CUDA takes the CUDA branch).

Apart from `dispatch` because the references ask `cuda_path` too, and `dispatch` imports them."""

from __future__ import annotations

import functools
import os

from torch import Tensor

KERNELS_ENV = "HIMAMBA_KERNELS"
KERNEL_CHOICES = ("auto", "reference", "triton", "native")
CUDA_PATH_ENV = "HIMAMBA_CUDA_PATH"


@functools.cache
def kernels_mode() -> str:
    """HIMAMBA_KERNELS, read once per process and checked: "auto" (default), "reference" or "triton"."""
    mode = os.environ.get(KERNELS_ENV, "auto") or "auto"
    if mode not in KERNEL_CHOICES:
        raise ValueError(f"{KERNELS_ENV} must be one of {', '.join(KERNEL_CHOICES)}, got {mode!r}")
    return mode


def cuda_path(t: Tensor) -> bool:
    """Whether code that branches on CPU vs CUDA takes the CUDA branch for `t` (no host syncs, no
    shapes read back from device values, pool rows updated in place): a CUDA tensor; or any tensor
    under HIMAMBA_KERNELS=triton (the twins are what a GPU runs) or HIMAMBA_CUDA_PATH=1 (read per
    call, so a test can set it), so that a CPU process (with TRITON_INTERPRET=1) runs what a GPU would."""
    return t.is_cuda or os.environ.get(CUDA_PATH_ENV) == "1" or kernels_mode() == "triton"
