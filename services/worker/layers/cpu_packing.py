"""Projection weights pre-packed once at load for the CPU GEMM path, as vLLM's CPU engine does.

On the CPU, `F.linear` goes to MKL's sgemm, which is slow for the few-row products of decode steps
(B rows against a [out, in] matrix): on a 2-core AMD EPYC (AVX-512) a [8, 512] x [512, 8192]
product took 6.3 ms through `F.linear` and 2.0 ms through oneDNN with the weight reordered once
into its blocked layout (medians of 60 alternating runs, loaded machine; 1.4-3x at 8 and 32 rows,
about equal at 1 row). oneDNN in turn reads a decode step's weights at 12-17 GB/s where a sequential
read reaches 25-30: float32 weights therefore go to the native kernels' column panels where they are
built (kernels/native/linear.c; a batch-1 step's 17 products 4.3 -> 2.3 ms on one thread, level with
oneDNN at prefill), other dtypes to oneDNN. The packed copy is opaque and extra memory (one more
copy of every packed matrix); the plain weight stays the model's parameter (state dict, tied
embeddings, cost figures).
"""

from __future__ import annotations

import torch

from himamba.kernels import dispatch
from himamba.kernels.dispatch import PanelWeight

# A packed weight: the native kernels' panels (float32) or oneDNN's opaque tensor.
Packed = PanelWeight | torch.Tensor


def can_pack(weight: torch.Tensor) -> bool:
    """oneDNN packing applies: a CPU float32 / bfloat16 matrix (not on the CUDA path, see
    `dispatch.cuda_path`) and a torch built with oneDNN."""
    return (
        not dispatch.cuda_path(weight)
        and weight.dim() == 2
        and weight.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
    )


def pack(weight: torch.Tensor, rows_hint: int = 8) -> Packed:
    """`weight` [out, in] packed: into the native kernels' panels where they take it, else into
    oneDNN's layout for products of about `rows_hint` rows (any row count works; the hint picks the
    blocking)."""
    panels = dispatch.pack_linear(weight)
    if panels is not None:
        return panels
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)


def packed_linear(x: torch.Tensor, packed: Packed, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ weight.T (+ bias) with a weight from `pack`."""
    if isinstance(packed, PanelWeight):
        return dispatch.packed_linear(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_model(model: torch.nn.Module) -> int:
    """Pack every module's projection that supports it (`pack_for_cpu()`); returns how many were packed.
    Call once the weights are loaded: a packed copy does not follow later changes to the weight."""
    return sum(1 for m in model.modules() if hasattr(m, "pack_for_cpu") and m.pack_for_cpu())
