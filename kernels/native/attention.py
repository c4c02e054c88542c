"""Attention over the paged KV pool, reading K/V rows where they lie: a batch's decode step
(paged_attention.c) and the prefill of one sequence or of a packed batch, flash style
(prefill_attention.c)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..reference.attention import check_decode_args, check_prefill_args, check_prefill_varlen_args
from ..varlen import Varlen, host_index
from .build import native_build


def supports(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> bool:
    """Whether the attention kernels take these tensors: float32, a contiguous pool."""
    return (
        q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


def paged_attention_decode(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, slot_table: Tensor, seq_lens: Tensor, scale: float
) -> Tensor:
    """As `reference.attention.paged_attention_decode` for float32 CPU tensors; a slot outside the
    pool is a ValueError (nothing is read from it)."""
    check_decode_args(q, k_cache, v_cache, slot_table, seq_lens)
    library = native_build().library
    assert library is not None
    q = q.contiguous()
    slot_table = slot_table.contiguous()
    seq_lens = seq_lens.contiguous()
    batch, q_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if batch == 0:
        return out
    status = library.hm_paged_attention_decode_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slot_table.data_ptr(), seq_lens.data_ptr(),
        out.data_ptr(), batch, q_heads, k_cache.shape[1], head_dim, slot_table.shape[1], k_cache.shape[0], scale,
    )  # fmt: skip
    if status == -1:
        raise ValueError(f"slot_table holds a slot outside the pool's {k_cache.shape[0]} (or a length out of range)")
    if status != 0:
        raise MemoryError("paged_attention_decode: out of memory for the scores")
    return out


def paged_attention_prefill(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, seq_slots: Tensor, prefix_len: int, scale: float
) -> Tensor:
    """As `reference.attention.paged_attention_prefill` for float32 CPU tensors; a slot outside the
    pool is a ValueError."""
    check_prefill_args(q, k_cache, v_cache, seq_slots, prefix_len)
    library = native_build().library
    assert library is not None
    q = q.contiguous()
    seq_slots = seq_slots.contiguous()
    tokens, q_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if tokens == 0:
        return out
    status = library.hm_paged_attention_prefill_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), seq_slots.data_ptr(), out.data_ptr(), tokens,
        prefix_len, q_heads, k_cache.shape[1], head_dim, k_cache.shape[0], scale,
    )  # fmt: skip
    if status == -1:
        raise ValueError(f"seq_slots holds a slot outside the pool's {k_cache.shape[0]}")
    if status != 0:
        raise MemoryError("paged_attention_prefill: out of memory for the blocks")
    return out


def paged_attention_prefill_varlen(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, slot_table: Tensor, v: Varlen, scale: float
) -> Tensor:
    """As `reference.attention.paged_attention_prefill` for each sequence of the packed batch `v`
    (float32 CPU tensors), all in one native call; a slot outside the pool in any sequence is a
    ValueError (nothing is written then)."""
    check_prefill_varlen_args(q, k_cache, v_cache, slot_table, v)
    library = native_build().library
    assert library is not None
    q = q.contiguous()
    if slot_table.stride(1) != 1:  # rows may lie apart (a slice of a wider table), not their entries
        slot_table = slot_table.contiguous()
    tokens, q_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if tokens == 0:
        return out
    batch, index = v.num_seqs, host_index(v)  # the lengths the arguments were checked against, on the host
    status = library.hm_paged_attention_prefill_varlen_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slot_table.data_ptr(), index.cu_seqlens.data_ptr(),
        index.prefix.data_ptr(), out.data_ptr(), batch, tokens, slot_table.shape[1], slot_table.stride(0), q_heads,
        k_cache.shape[1], head_dim, k_cache.shape[0], scale,
    )  # fmt: skip
    if status == -1:
        raise ValueError(f"slot_table holds a slot outside the pool's {k_cache.shape[0]}")
    if status != 0:
        raise MemoryError("paged_attention_prefill_varlen: out of memory for the blocks")
    return out
