"""Attention of a batch's projected q/k/v over the paged KV pool, for attention modules whose
projections differ from `PagedAttention`'s (gates, adapters, q/k norms, multipliers)."""

from __future__ import annotations

import torch

from himamba.kernels import paged_attention_decode, paged_attention_prefill_varlen, write_kv
from himamba.services.worker.forward_batch import ForwardBatch


def paged_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: ForwardBatch,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] (positions already applied) -> [T, Hq, D].

    Writes the new K/V at `batch.write_slots` first, so each sequence attends causally to its cached
    prefix and its own new tokens; a prefill attends for every sequence in one varlen call.
    """
    write_kv(k_cache, v_cache, batch.write_slots, k, v)
    if batch.mode == "decode":
        return paged_attention_decode(q, k_cache, v_cache, batch.slot_table, batch.seq_lens, scale)
    return paged_attention_prefill_varlen(q, k_cache, v_cache, batch.prefill_table, batch.varlen, scale)
