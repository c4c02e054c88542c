"""Twins of `reference.attention`: paged prefill and decode attention (online softmax), and the KV write.

Both attention kernels read K/V rows straight from the layer's pool [S, Hkv, Dh] through the
sequence's token slots. Prefill runs one program per (block of new tokens, query head); decode
one program per (sequence, kv head) with the kv head's query heads as the rows of one tile
(grouped-query attention reads each K/V row once for all of them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..reference import attention as _ref
from ..varlen import Varlen
from .jit_math import dot_precision, next_pow2


@triton.jit
def _attend_block(q, acc, m_i, l_i, k_ptr, v_ptr, slots, key_mask, ds, d_mask, sk_s, sk_h, sv_s, sv_h, kv_head,
                  scale, valid, PRECISION: tl.constexpr):  # fmt: skip
    """One block of keys into the online softmax: returns the new (acc, max, sum)."""
    kv_mask = key_mask[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + slots[:, None] * sk_s + kv_head * sk_h + ds[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + slots[:, None] * sv_s + kv_head * sv_h + ds[None, :], mask=kv_mask, other=0.0)
    scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION) * scale
    scores = tl.where(valid, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    p = tl.exp(scores - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, slots_ptr, out_ptr,
    new_len, prefix_len, heads_per_kv, head_dim, scale,
    sq_t, sq_h, sk_s, sk_h, sv_s, sv_h, so_t, so_h,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    ms = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    head = tl.program_id(1)
    kv_head = head // heads_per_kv
    m_mask = ms < new_len
    ds = tl.arange(0, BLOCK_D)
    d_mask = ds < head_dim
    q = tl.load(q_ptr + ms[:, None] * sq_t + head * sq_h + ds[None, :], mask=m_mask[:, None] & d_mask[None, :],
                other=0.0).to(tl.float32)  # fmt: skip
    query_pos = prefix_len + ms
    # Keys up to the block's last query (causal); every query sees key 0, so no row is empty.
    end = tl.minimum(prefix_len + new_len, prefix_len + (tl.program_id(0) + 1) * BLOCK_M)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for start in range(0, end, BLOCK_N):
        ns = start + tl.arange(0, BLOCK_N)
        key_mask = ns < end
        slots = tl.load(slots_ptr + ns, mask=key_mask, other=0)
        valid = key_mask[None, :] & (ns[None, :] <= query_pos[:, None])
        acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, k_ptr, v_ptr, slots, key_mask, ds, d_mask, sk_s, sk_h,
                                      sv_s, sv_h, kv_head, scale, valid, PRECISION)  # fmt: skip
    out = acc / l_i[:, None]
    tl.store(out_ptr + ms[:, None] * so_t + head * so_h + ds[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & d_mask[None, :])  # fmt: skip


@triton.jit
def _prefill_varlen_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, cu_ptr, prefix_ptr, out_ptr,
    heads_per_kv, head_dim, scale,
    sq_t, sq_h, sk_s, sk_h, sv_s, sv_h, st_b, st_l, so_t, so_h,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(2)
    bos = tl.load(cu_ptr + seq).to(tl.int32)
    new_len = tl.load(cu_ptr + seq + 1).to(tl.int32) - bos
    prefix_len = tl.load(prefix_ptr + seq).to(tl.int32)
    ms = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    head = tl.program_id(1)
    kv_head = head // heads_per_kv
    m_mask = ms < new_len
    rows = (bos + ms).to(tl.int64)
    ds = tl.arange(0, BLOCK_D)
    d_mask = ds < head_dim
    q = tl.load(q_ptr + rows[:, None] * sq_t + head * sq_h + ds[None, :], mask=m_mask[:, None] & d_mask[None, :],
                other=0.0).to(tl.float32)  # fmt: skip
    query_pos = prefix_len + ms
    # Keys up to the block's last query (causal); a block past the sequence's end reads none (its
    # grid covers the longest sequence of the step).
    end = tl.minimum(prefix_len + new_len, prefix_len + (tl.program_id(0) + 1) * BLOCK_M)
    end = tl.where(tl.program_id(0) * BLOCK_M < new_len, end, 0)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for start in range(0, end, BLOCK_N):
        ns = start + tl.arange(0, BLOCK_N)
        key_mask = ns < end
        slots = tl.load(table_ptr + seq * st_b + ns * st_l, mask=key_mask, other=0)
        valid = key_mask[None, :] & (ns[None, :] <= query_pos[:, None])
        acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, k_ptr, v_ptr, slots, key_mask, ds, d_mask, sk_s, sk_h,
                                      sv_s, sv_h, kv_head, scale, valid, PRECISION)  # fmt: skip
    out = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * so_t + head * so_h + ds[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & d_mask[None, :])  # fmt: skip


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr,
    heads_per_kv, head_dim, scale,
    sq_b, sq_h, sk_s, sk_h, sv_s, sv_h, st_b, st_l, so_b, so_h,
    PRECISION: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    hs = kv_head * heads_per_kv + tl.arange(0, BLOCK_H)
    h_mask = tl.arange(0, BLOCK_H) < heads_per_kv
    ds = tl.arange(0, BLOCK_D)
    d_mask = ds < head_dim
    q = tl.load(q_ptr + b * sq_b + hs[:, None] * sq_h + ds[None, :], mask=h_mask[:, None] & d_mask[None, :],
                other=0.0).to(tl.float32)  # fmt: skip
    seq_len = tl.load(lens_ptr + b)
    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        ns = start + tl.arange(0, BLOCK_N)
        key_mask = ns < seq_len
        slots = tl.load(table_ptr + b * st_b + ns * st_l, mask=key_mask, other=0)
        # Rows past the group's heads hold q = 0: finite scores, never stored.
        acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, k_ptr, v_ptr, slots, key_mask, ds, d_mask, sk_s, sk_h,
                                      sv_s, sv_h, kv_head, scale, key_mask[None, :], PRECISION)  # fmt: skip
    out = acc / l_i[:, None]
    tl.store(out_ptr + b * so_b + hs[:, None] * so_h + ds[None, :], out.to(out_ptr.dtype.element_ty),
             mask=h_mask[:, None] & d_mask[None, :])  # fmt: skip


@triton.jit
def _write_kernel(k_cache_ptr, v_cache_ptr, slots_ptr, k_ptr, v_ptr, row_len, sk_t, sv_t, sc_s, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < row_len
    slot = tl.load(slots_ptr + t)
    k = tl.load(k_ptr + t * sk_t + cols, mask=mask)
    v = tl.load(v_ptr + t * sv_t + cols, mask=mask)
    tl.store(k_cache_ptr + slot * sc_s + cols, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * sc_s + cols, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _unit_last(*tensors: Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"the Triton attention kernels need a unit stride on the head dim, got {t.stride()}")


def paged_attention_prefill(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, seq_slots: Tensor, prefix_len: int, scale: float
) -> Tensor:
    """Twin of `reference.attention.paged_attention_prefill`."""
    _ref.check_prefill_args(q, k_cache, v_cache, seq_slots, prefix_len)
    new_len, q_heads, head_dim = q.shape
    _unit_last(q, k_cache, v_cache)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    block_m = 32
    grid = (triton.cdiv(new_len, block_m), q_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, seq_slots, out,
        new_len, prefix_len, q_heads // k_cache.shape[1], head_dim, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1),
        PRECISION=dot_precision(q, k_cache), BLOCK_M=block_m, BLOCK_N=32, BLOCK_D=next_pow2(head_dim, 16),
    )  # fmt: skip
    return out


def paged_attention_prefill_varlen(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, slot_table: Tensor, v: Varlen, scale: float
) -> Tensor:
    """Twin of `segmented`'s prefill attention over a packed batch: one launch for every sequence."""
    _ref.check_prefill_varlen_args(q, k_cache, v_cache, slot_table, v)
    _, q_heads, head_dim = q.shape
    _unit_last(q, k_cache, v_cache)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    block_m = 32
    grid = (triton.cdiv(v.max_len, block_m), q_heads, v.num_seqs)
    _prefill_varlen_kernel[grid](
        q, k_cache, v_cache, slot_table, v.cu_seqlens, v.prefix, out,
        q_heads // k_cache.shape[1], head_dim, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        slot_table.stride(0), slot_table.stride(1), out.stride(0), out.stride(1),
        PRECISION=dot_precision(q, k_cache), BLOCK_M=block_m, BLOCK_N=32, BLOCK_D=next_pow2(head_dim, 16),
    )  # fmt: skip
    return out


def paged_attention_decode(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, slot_table: Tensor, seq_lens: Tensor, scale: float
) -> Tensor:
    """Twin of `reference.attention.paged_attention_decode` (lengths are not range-checked on CUDA)."""
    _ref.check_decode_args(q, k_cache, v_cache, slot_table, seq_lens)
    batch, q_heads, head_dim = q.shape
    _unit_last(q, k_cache, v_cache)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    kv_heads = k_cache.shape[1]
    rep = q_heads // kv_heads
    _decode_kernel[(batch, kv_heads)](
        q, k_cache, v_cache, slot_table, seq_lens, out,
        rep, head_dim, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        slot_table.stride(0), slot_table.stride(1), out.stride(0), out.stride(1),
        PRECISION=dot_precision(q, k_cache), BLOCK_H=next_pow2(rep, 16), BLOCK_N=32, BLOCK_D=next_pow2(head_dim, 16),
    )  # fmt: skip
    return out


def write_kv(k_cache: Tensor, v_cache: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
    """Twin of `reference.attention.write_kv`."""
    _ref._check_index("slots", slots, 1)
    expected = (slots.shape[0], *k_cache.shape[1:])
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache shapes differ: {tuple(k_cache.shape)} vs {tuple(v_cache.shape)}")
    if tuple(k.shape) != expected or tuple(v.shape) != expected:
        raise ValueError(f"k and v must be {list(expected)}, got {tuple(k.shape)} and {tuple(v.shape)}")
    if slots.shape[0] == 0:
        return
    if k_cache.stride() != v_cache.stride() or not k_cache[:1].is_contiguous():
        raise ValueError(
            f"k_cache and v_cache must be contiguous pools, got strides {k_cache.stride()}, {v_cache.stride()}"
        )
    # The kernel copies each token's [Hkv, Dh] as one row: new K/V from a split projection already are.
    k, v = (t if t[:1].is_contiguous() else t.contiguous() for t in (k, v))
    row_len = k_cache.shape[1] * k_cache.shape[2]
    block = min(1024, next_pow2(row_len))
    _write_kernel[(slots.shape[0], triton.cdiv(row_len, block))](
        k_cache, v_cache, slots, k, v, row_len, k.stride(0), v.stride(0), k_cache.stride(0), BLOCK=block
    )
