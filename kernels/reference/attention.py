"""Attention over the paged KV pool: prefill of one sequence, decode of a batch, and the KV write.

The pool of one layer is k_cache, v_cache: [S, Hkv, Dh], indexed by token slot. A sequence's
context is the ordered list of its token slots. For a query at context position i:

    out_i = softmax_j<=i(scale * q_i · k_j) · v_j

with grouped-query attention: query head h reads kv head h // (Hq / Hkv).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..code_path import cuda_path
from ..varlen import Varlen


def _check_cache(k_cache: Tensor, v_cache: Tensor, q_heads: int, head_dim: int) -> None:
    if k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [S, Hkv, Dh], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    kv_heads = k_cache.shape[1]
    if k_cache.shape[2] != head_dim:
        raise ValueError(f"k_cache head dim must be q's ({head_dim}), got {k_cache.shape[2]}")
    if q_heads % kv_heads != 0:
        raise ValueError(f"q heads ({q_heads}) must be a multiple of the cache's kv heads ({kv_heads})")


def _check_index(name: str, t: Tensor, dims: int) -> None:
    if t.dim() != dims or t.dtype != torch.int64:
        raise ValueError(f"{name} must be a {dims}-d int64 tensor, got {t.dtype} {tuple(t.shape)}")


def check_prefill_args(q: Tensor, k_cache: Tensor, v_cache: Tensor, seq_slots: Tensor, prefix_len: int) -> None:
    """Raise ValueError unless the arguments of `paged_attention_prefill` fit together (every
    implementation checks them so)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, Dh], got {tuple(q.shape)}")
    new_len, q_heads, head_dim = q.shape
    _check_cache(k_cache, v_cache, q_heads, head_dim)
    _check_index("seq_slots", seq_slots, 1)
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
    if seq_slots.shape[0] != prefix_len + new_len:
        raise ValueError(
            f"seq_slots must have prefix_len + T = {prefix_len + new_len} entries, got {seq_slots.shape[0]}"
        )


def check_prefill_varlen_args(q: Tensor, k_cache: Tensor, v_cache: Tensor, slot_table: Tensor, v: Varlen) -> None:
    """Raise ValueError unless the arguments of a varlen prefill attention (q [T, Hq, Dh] packed as `v`
    says, slot_table [B, >= longest prefix + new tokens] of token slots) fit together."""
    if q.dim() != 3 or q.shape[0] != v.num_tokens:
        raise ValueError(f"q must be [T={v.num_tokens}, Hq, Dh], got {tuple(q.shape)}")
    _check_cache(k_cache, v_cache, q.shape[1], q.shape[2])
    _check_index("slot_table", slot_table, 2)
    width = max((p + n for p, n in zip(v.prefix_lens, v.new_lens, strict=True)), default=0)
    if slot_table.shape[0] != v.num_seqs or slot_table.shape[1] < width:
        raise ValueError(f"slot_table must be [{v.num_seqs}, >= {width}], got {tuple(slot_table.shape)}")


def paged_attention_prefill(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, seq_slots: Tensor, prefix_len: int, scale: float
) -> Tensor:
    """Causal attention of one sequence's new tokens q [T, Hq, Dh] over its whole context.

    seq_slots [prefix_len + T] are the context's token slots in order; the new tokens' K/V must
    already be written at the last T of them. New token i sees context positions 0..prefix_len+i.
    Returns [T, Hq, Dh] in q's dtype.
    """
    check_prefill_args(q, k_cache, v_cache, seq_slots, prefix_len)
    new_len = q.shape[0]

    # A leading batch dim of 1: torch's CPU flash kernel takes only 4-d inputs (3-d falls back to
    # the slower math path).
    k = k_cache.index_select(0, seq_slots).to(q.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, prefix+T, Dh]
    v = v_cache.index_select(0, seq_slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, T, Dh]
    if prefix_len == 0:
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # is_causal aligns the mask top-left, which is wrong once queries start at prefix_len.
        key_pos = torch.arange(prefix_len + new_len, device=q.device)
        query_pos = torch.arange(prefix_len, prefix_len + new_len, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]  # [T, prefix+T]
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).contiguous()


def check_decode_args(q: Tensor, k_cache: Tensor, v_cache: Tensor, slot_table: Tensor, seq_lens: Tensor) -> None:
    """Raise ValueError unless the arguments of `paged_attention_decode` fit together (every
    implementation checks them so)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, Dh], got {tuple(q.shape)}")
    batch, q_heads, head_dim = q.shape
    _check_cache(k_cache, v_cache, q_heads, head_dim)
    _check_index("slot_table", slot_table, 2)
    _check_index("seq_lens", seq_lens, 1)
    if slot_table.shape[0] != batch or seq_lens.shape[0] != batch:
        raise ValueError(
            f"slot_table and seq_lens must have B={batch} rows, got {slot_table.shape[0]} and {seq_lens.shape[0]}"
        )
    max_len = slot_table.shape[1]
    # The lengths' range is read on the CPU path only: on a GPU the read would be a sync per layer.
    if not cuda_path(seq_lens) and batch > 0:
        lo, hi = int(seq_lens.min()), int(seq_lens.max())
        if lo < 1 or hi > max_len:
            raise ValueError(f"seq_lens must be in [1, max_len={max_len}], got min {lo} max {hi}")


def paged_attention_decode(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, slot_table: Tensor, seq_lens: Tensor, scale: float
) -> Tensor:
    """One new token per sequence, q [B, Hq, Dh], attending to its context; returns [B, Hq, Dh].

    slot_table [B, max_len] holds each context's token slots in order (any valid slot past
    seq_lens); seq_lens [B] count the context including the new token, whose K/V must already be
    in the cache. Lengths are range-checked only for CPU tensors (elsewhere it would cost a sync).
    """
    check_decode_args(q, k_cache, v_cache, slot_table, seq_lens)
    batch, q_heads, head_dim = q.shape
    max_len = slot_table.shape[1]
    kv_heads = k_cache.shape[1]
    # One gather for the whole batch: [B * max_len] slots -> [B, Hkv, max_len, Dh].
    flat = slot_table.reshape(-1)
    k = k_cache.index_select(0, flat).view(batch, max_len, kv_heads, head_dim).to(q.dtype).transpose(1, 2)
    v = v_cache.index_select(0, flat).view(batch, max_len, kv_heads, head_dim).to(q.dtype).transpose(1, 2)
    valid = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None]  # [B, max_len]
    # The query heads that share a kv head (h // rep) are the rows of one query block over that
    # head's keys: one product per (sequence, kv head), and K/V never repeated per query head
    # (enable_gqa's way); 1.1-1.2x faster on CPU at batch 8-32.
    rep = q_heads // kv_heads
    out = F.scaled_dot_product_attention(
        q.reshape(batch, kv_heads, rep, head_dim), k, v, attn_mask=valid[:, None, None, :], scale=scale
    )  # [B, Hkv, rep, Dh]
    return out.reshape(batch, q_heads, head_dim)


def write_kv(k_cache: Tensor, v_cache: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
    """Store k, v [T, Hkv, Dh] at token slots [T] of the caches (in place, cast to the cache dtype)."""
    _check_index("slots", slots, 1)
    expected = (slots.shape[0], *k_cache.shape[1:])
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache shapes differ: {tuple(k_cache.shape)} vs {tuple(v_cache.shape)}")
    if tuple(k.shape) != expected or tuple(v.shape) != expected:
        raise ValueError(f"k and v must be {list(expected)}, got {tuple(k.shape)} and {tuple(v.shape)}")
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
