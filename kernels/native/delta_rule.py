"""Qwen3-Next's gated delta rule over a packed varlen prefill batch with its captures, in one parallel
region (delta_rule.c): every sequence's tokens in order, states read from and written into the pool."""

from __future__ import annotations

import torch
from torch import Tensor

from ..reference.delta_rule import _check_layout
from ..varlen import Varlen, host_index, host_slots
from .build import native_build
from .ssd import _inner_contiguous


def supports_varlen(q: Tensor, k: Tensor, val: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor) -> bool:
    """Whether `gated_delta_rule_varlen` takes these tensors: float32, the pool contiguous (written in place)."""
    return all(t.dtype == torch.float32 for t in (q, k, val, g, beta, state_pool)) and state_pool.is_contiguous()


def check_varlen_args(
    q: Tensor, k: Tensor, val: Tensor, g: Tensor, beta: Tensor, chunk_size: int, state_pool: Tensor,
    state_slots: Tensor, v: Varlen,
) -> None:  # fmt: skip
    """ValueError unless q, k [T, Hk, Dk], val [T, Hv, Dv], g, beta [T, Hv], the pool [slots, Hv, Dk, Dv]
    and one slot per sequence fit together (as the Triton twin checks them)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    _check_layout(q[None], k[None], val[None], g[None], beta[None], token_dims=2)
    if q.shape[0] != v.num_tokens:
        raise ValueError(f"q must be [T={v.num_tokens}, Hk, Dk], got {tuple(q.shape)}")
    row = (val.shape[1], q.shape[2], val.shape[2])
    if state_pool.dim() != 4 or tuple(state_pool.shape[1:]) != row:
        raise ValueError(f"state_pool must be [slots, {', '.join(map(str, row))}], got {tuple(state_pool.shape)}")
    if state_slots.dim() != 1 or state_slots.shape[0] != v.num_seqs:
        raise ValueError(f"state_slots must be [{v.num_seqs}], got {tuple(state_slots.shape)}")


def gated_delta_rule_varlen(
    q: Tensor,
    k: Tensor,
    val: Tensor,
    g: Tensor,
    beta: Tensor,
    chunk_size: int,
    state_pool: Tensor,
    state_slots: Tensor,
    v: Varlen,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
) -> Tensor:
    """As `dispatch.chunk_gated_delta_rule_varlen` for float32 CPU tensors: every sequence in one parallel
    region, the output written once, states read from and written (captures, final) into `state_pool`.
    The recurrence runs token by token (see delta_rule.c), so `chunk_size` is only checked. A slot
    outside the pool is a ValueError (nothing is written then)."""
    check_varlen_args(q, k, val, g, beta, chunk_size, state_pool, state_slots, v)
    library = native_build().library
    assert library is not None
    total, k_heads, k_dim = q.shape
    v_heads, v_dim = val.shape[1], val.shape[2]
    out = q.new_empty(total, v_heads, v_dim)
    q, k, val = (t if _inner_contiguous(t, 2) else t.contiguous() for t in (q, k, val))
    g, beta = (t if _inner_contiguous(t, 1) else t.contiguous() for t in (g, beta))
    slots, index = host_slots(state_slots, v), host_index(v)  # exactly what was checked, on the host
    status = library.hm_gated_delta_rule_varlen_f32(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), val.data_ptr(), val.stride(0), g.data_ptr(),
        g.stride(0), beta.data_ptr(), beta.stride(0), int(use_qk_l2norm), k_dim**-0.5 if scale is None else scale,
        state_pool.data_ptr(), state_pool.shape[0], slots.data_ptr(), index.prefix.data_ptr(), index.cu_seqlens.data_ptr(),
        index.cu_captures.data_ptr(), index.capture_offsets.data_ptr(), index.capture_slots.data_ptr(), out.data_ptr(),
        v.num_seqs, k_heads, v_heads, k_dim, v_dim,
    )  # fmt: skip
    if status == -1:
        raise ValueError(f"state_slots or a capture slot lies outside the pool's {state_pool.shape[0]} slots")
    if status != 0:
        raise MemoryError("gated_delta_rule_varlen: out of memory for the state slices")
    return out
