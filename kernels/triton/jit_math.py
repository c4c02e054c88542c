"""Scalar functions shared by the twins' kernels, and the launch-time choices they all make."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def softplus(x):
    """F.softplus(x) with beta 1 and its default threshold 20 (above it: x, where exp would overflow)."""
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def silu(x):
    """x * sigmoid(x), in float32."""
    return x / (1.0 + tl.exp(-x))


def next_pow2(n: int, at_least: int = 1) -> int:
    """The smallest power of two >= max(n, at_least): triton block shapes must be powers of two."""
    return max(triton.next_power_of_2(max(n, 1)), at_least)


def dot_precision(*tensors: Tensor | None) -> str:
    """`input_precision` of the kernels' tl.dot for these inputs.

    float32 inputs get exact float32 products ("ieee"), as the references compute. With
    half-precision inputs (8-11 mantissa bits) the results are rounded to that precision anyway,
    so tf32 products on tensor cores (10 bits) cost no accuracy that the output keeps.
    """
    if any(t is not None and t.dtype == torch.float32 for t in tensors):
        return "ieee"
    return "tf32"
