"""The one place that chooses an implementation for each kernel; today always the PyTorch reference.

Every function here has the exact signature (and contract) of its reference in
`himamba.kernels.reference`, so callers never import an implementation directly.

How a Triton (or other device) implementation plugs in:
  1. Put it in `kernels/triton/<family>.py` (a new package: add `himamba.kernels.triton` to
     pyproject's `packages`) with the same signature and result types (`ConvResult`, `ScanResult`
     from the reference files), importing triton lazily so CPU-only installs keep working.
  2. Test it against the reference on random inputs under a GPU-only test.
  3. Here, branch on the inputs: `if x.is_cuda: return triton_impl(...)`, else fall through to
     the reference. Nothing else changes; the choice is made per call from the inputs only, so
     there is no global switch to set.
"""

from __future__ import annotations

from torch import Tensor

from .reference import attention as _attention
from .reference import conv1d as _conv1d
from .reference import norm as _norm
from .reference import ssd as _ssd
from .reference.conv1d import ConvResult
from .reference.ssd import ScanResult


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    initial_state: Tensor | None,
    activation: str | None = "silu",
) -> ConvResult:
    """Causal depthwise conv of a segment; see `reference.conv1d.causal_conv1d`."""
    return _conv1d.causal_conv1d(x, weight, bias, initial_state, activation)


def causal_conv1d_update(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    activation: str | None = "silu",
) -> Tensor:
    """One decode step of the conv, updating conv_state in place; see `reference.conv1d`."""
    return _conv1d.causal_conv1d_update(x, conv_state, weight, bias, activation)


def ssd_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    initial_state: Tensor | None = None,
) -> ScanResult:
    """Mamba2 chunked scan (prefill); see `reference.ssd.ssd_scan`."""
    return _ssd.ssd_scan(x, dt, A, B, C, chunk_size, D, dt_bias, dt_softplus, dt_limit, initial_state)


def selective_state_update(
    state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> Tensor:
    """One decode step of the Mamba2 recurrence, updating state in place; see `reference.ssd`."""
    return _ssd.selective_state_update(state, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit)


def rms_norm(x: Tensor, weight: Tensor, eps: float, multiply_in_float32: bool = False) -> Tensor:
    """RMSNorm over the last dim; see `reference.norm.rms_norm` for `multiply_in_float32`."""
    return _norm.rms_norm(x, weight, eps, multiply_in_float32)


def gated_rms_norm(x: Tensor, gate: Tensor | None, weight: Tensor, eps: float, group_size: int) -> Tensor:
    """Gated, grouped RMSNorm of Mamba2 mixers; see `reference.norm.gated_rms_norm`."""
    return _norm.gated_rms_norm(x, gate, weight, eps, group_size)


def paged_attention_prefill(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, seq_slots: Tensor, prefix_len: int, scale: float
) -> Tensor:
    """Causal attention of one sequence's new tokens over the paged pool; see `reference.attention`."""
    return _attention.paged_attention_prefill(q, k_cache, v_cache, seq_slots, prefix_len, scale)


def paged_attention_decode(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, slot_table: Tensor, seq_lens: Tensor, scale: float
) -> Tensor:
    """Attention of one new token per sequence over the paged pool; see `reference.attention`."""
    return _attention.paged_attention_decode(q, k_cache, v_cache, slot_table, seq_lens, scale)


def write_kv(k_cache: Tensor, v_cache: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
    """Store new K/V at token slots of the layer's pool; see `reference.attention.write_kv`."""
    _attention.write_kv(k_cache, v_cache, slots, k, v)
