"""Validation of a ForwardBatch against what a hybrid model's forward needs."""

from __future__ import annotations

from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.pools import KVPool, StatePool


def check_batch(batch: ForwardBatch, kv: KVPool, state: StatePool, num_attention: int, num_recurrent: int) -> None:
    """Raise ValueError naming the first field of `batch` (or pool) that a forward cannot use.

    Only host-side facts are checked (list lengths, tensor shapes): nothing here reads device data.
    """
    num_seqs = len(batch.new_lens)
    if num_seqs == 0:
        raise ValueError("new_lens must not be empty")
    if len(batch.prefix_lens) != num_seqs:
        raise ValueError(f"prefix_lens must have one entry per sequence ({num_seqs}), got {len(batch.prefix_lens)}")
    if any(n < 1 for n in batch.new_lens):
        raise ValueError(f"new_lens must all be >= 1, got {batch.new_lens}")
    if any(p < 0 for p in batch.prefix_lens):
        raise ValueError(f"prefix_lens must all be >= 0, got {batch.prefix_lens}")
    total = sum(batch.new_lens)
    for name in ("input_ids", "positions", "write_slots"):
        t = getattr(batch, name)
        if t.dim() != 1 or t.shape[0] != total:
            raise ValueError(f"{name} must be [sum(new_lens)={total}], got {tuple(t.shape)}")
    if batch.mode == "decode":
        if any(n != 1 for n in batch.new_lens):
            raise ValueError(f"new_lens must all be 1 in decode, got {batch.new_lens}")
        if any(p < 1 for p in batch.prefix_lens):
            raise ValueError(f"prefix_lens must all be >= 1 in decode, got {batch.prefix_lens}")
        if batch.captures and any(batch.captures):
            raise ValueError("captures are only supported in prefill batches")
        if num_attention:
            if batch.slot_table is None or batch.slot_table.dim() != 2 or batch.slot_table.shape[0] != num_seqs:
                raise ValueError(f"slot_table must be [B={num_seqs}, max_len] in decode")
            if batch.seq_lens is None or tuple(batch.seq_lens.shape) != (num_seqs,):
                raise ValueError(f"seq_lens must be [B={num_seqs}] in decode")
    elif batch.mode == "prefill":
        if num_attention:
            if len(batch.seq_slots) != num_seqs:
                raise ValueError(
                    f"seq_slots must have one tensor per sequence ({num_seqs}), got {len(batch.seq_slots)}"
                )
            for i, slots in enumerate(batch.seq_slots):
                expected = batch.prefix_lens[i] + batch.new_lens[i]
                if slots.dim() != 1 or slots.shape[0] != expected:
                    raise ValueError(
                        f"seq_slots[{i}] must be [prefix_len + new_len = {expected}], got {tuple(slots.shape)}"
                    )
        if batch.captures:
            if len(batch.captures) != num_seqs:
                raise ValueError(f"captures must have one list per sequence ({num_seqs}), got {len(batch.captures)}")
            for i, caps in enumerate(batch.captures):
                for cap in caps:
                    if not 1 <= cap.offset <= batch.new_lens[i]:
                        raise ValueError(
                            f"captures[{i}] offset must be in [1, new_len={batch.new_lens[i]}], got {cap.offset}"
                        )
                    if not 0 <= cap.slot < state.num_slots:
                        raise ValueError(f"captures[{i}] slot must be in [0, {state.num_slots}), got {cap.slot}")
    else:
        raise ValueError(f"mode must be 'prefill' or 'decode', got {batch.mode!r}")
    if num_recurrent:
        if batch.state_slots is None or tuple(batch.state_slots.shape) != (num_seqs,):
            raise ValueError(f"state_slots must be [B={num_seqs}] for a model with recurrent layers")
        if state.num_layers != num_recurrent:
            raise ValueError(f"state pool must have {num_recurrent} recurrent layers, got {state.num_layers}")
    if num_attention and len(kv.k) != num_attention:
        raise ValueError(f"KV pool must have {num_attention} attention layers, got {len(kv.k)}")
