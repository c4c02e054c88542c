"""RMS normalisation of the residual stream, and the gated, grouped variant inside Mamba2 mixers.

    rms_norm(x)         = weight * x / sqrt(mean(x^2) + eps)                  over the last dim
    gated_rms_norm(x, z) = weight * u / sqrt(mean_group(u^2) + eps), u = x * silu(z)

Both compute in float32. Where the result is rounded back to x's dtype matters outside
float32 and differs between models (see `rms_norm`); the gated form is the same in the Mamba2,
NemotronH and GraniteMoeHybrid models of transformers (gate before norm, "norm_before_gate=False").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _check_weight(x: Tensor, weight: Tensor) -> None:
    if x.dim() < 1 or tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"weight must be [D={x.shape[-1] if x.dim() else '?'}], got {tuple(weight.shape)}")


def _normalize(x32: Tensor, eps: float) -> Tensor:
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


# From this many elements on (prefill rows), a float32 norm takes its mean square from one
# reduction (`_inverse_rms`) instead of squaring into a temporary and averaging it: one pass and
# one parallel op fewer, and each parallel op wakes the sleeping OpenMP threads. On a 2-core AMD EPYC, 2 threads,
# passive waits: [512, 512] 98 -> 77 us; a NemotronH prefill of 512 tokens 1.026x, of 2048 tokens
# 1.011x (A/B in one process). The mean square then differs from transformers' pow().mean() in
# the last bits; below it (decode rows), where F.rms_norm's single call is faster, it is bit-identical.
ONE_REDUCTION_MIN_NUMEL = 1 << 15


def _inverse_rms(x32: Tensor, eps: float) -> Tensor:
    """[..., 1] 1 / sqrt(mean(x^2) + eps) over the last dim of a float32 tensor."""
    norm = torch.linalg.vector_norm(x32, dim=-1, keepdim=True)
    return norm.square_().div_(x32.shape[-1]).add_(eps).rsqrt_()


def rms_norm(x: Tensor, weight: Tensor, eps: float, multiply_in_float32: bool = False) -> Tensor:
    """RMSNorm over the last dim of x [..., D]; returns x's dtype.

    By default the normalised value is cast to x's dtype before the weight multiply, as in
    transformers' GraniteMoeHybridRMSNorm / Mamba2RMSNorm (Llama style). NemotronHRMSNorm instead
    multiplies in float32 and casts the product: pass `multiply_in_float32=True` for it.
    """
    _check_weight(x, weight)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        if x.numel() >= ONE_REDUCTION_MIN_NUMEL:
            return (x * _inverse_rms(x, eps)).mul_(weight)
        # The same arithmetic in one ATen call (x * rsqrt(mean(x^2) + eps) * weight): bit-identical.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    normed = _normalize(x.float(), eps)
    if multiply_in_float32:
        return (weight.float() * normed).to(x.dtype)
    return (weight * normed.to(x.dtype)).to(x.dtype)


def check_args(x: Tensor, weight: Tensor) -> None:
    """Raise ValueError unless the arguments of `rms_norm` fit together (every implementation checks them so)."""
    _check_weight(x, weight)


def check_gated_args(x: Tensor, gate: Tensor | None, weight: Tensor, group_size: int) -> None:
    """Raise ValueError unless the arguments of `gated_rms_norm` fit together (every implementation checks them so)."""
    _check_weight(x, weight)
    width = x.shape[-1]
    if group_size < 1 or width % group_size != 0:
        raise ValueError(f"group_size must divide D={width}, got {group_size}")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")


def gated_rms_norm(x: Tensor, gate: Tensor | None, weight: Tensor, eps: float, group_size: int) -> Tensor:
    """x * silu(gate) (gate None: x alone), RMS-normalised over groups of `group_size` channels, times weight.

    x, gate: [..., D] with D % group_size == 0; returns x's dtype (cast before the weight multiply,
    as transformers' MambaRMSNormGated, NemotronHRMSNormGated and GraniteMoeHybridRMSNormGated do).
    """
    check_gated_args(x, gate, weight, group_size)
    width = x.shape[-1]
    if gate is None:
        u = x.float()
    else:
        # silu(gate) * x is x * silu(gate) bit for bit; multiplying into the fresh silu saves a pass.
        u = F.silu(gate.float()).mul_(x)
    grouped = u.reshape(*x.shape[:-1], width // group_size, group_size)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        if x.numel() >= ONE_REDUCTION_MIN_NUMEL:
            return (grouped * _inverse_rms(grouped, eps)).view(x.shape).mul_(weight)
        return F.rms_norm(grouped, (group_size,), None, eps).view(x.shape).mul_(weight)
    normed = _normalize(grouped, eps).reshape(x.shape)
    return (weight * normed.to(x.dtype)).to(x.dtype)
