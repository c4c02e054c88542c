"""Turn a RunBatch (what the scheduler decided) into a ForwardBatch (what the model reads).

No policy lives here: pages, slots and captures come from the scheduler and the cache
controller; the runner only lays them out as tensors on the worker's device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from himamba.common.messages import RunBatch, SeqPlan
from himamba.common.wire import WireError, get_ints, get_tensor
from himamba.services.worker.forward_batch import Capture, ForwardBatch
from himamba.services.worker.page_tables import PageTables, SeqState
from himamba.services.worker.penalties import host_values


def build_forward_batch(
    plan: RunBatch, frames: list[Any], tables: PageTables, num_slots: int, device: torch.device
) -> tuple[ForwardBatch, list[SeqState]]:
    """Validate the plan, apply its page-table deltas to `tables`, and build the model's batch
    tensors. Returns the batch and each sequence's state (its sampling parameters, penalties)."""
    if plan.input_ids is None or plan.pages is None:
        raise WireError("RunBatch without input_ids/pages tensors")
    ids_cpu = get_tensor(frames, plan.input_ids)
    input_ids = ids_cpu.to(device=device, dtype=torch.int64)
    pages_cpu = get_tensor(frames, plan.pages)
    page_values = get_ints(frames, plan.pages)
    seqs = plan.seqs
    if input_ids.numel() != sum(s.new_len for s in seqs):
        raise WireError(f"input_ids has {input_ids.numel()} tokens, plan says {sum(s.new_len for s in seqs)}")
    if pages_cpu.numel() != sum(s.num_new_pages for s in seqs):
        raise WireError("pages tensor does not match the plan")
    start = 0
    for s in seqs:
        # Checked on the host, before the pages go to the device (no synchronisation there).
        tables.check_pages(s, page_values[start : start + s.num_new_pages])
        start += s.num_new_pages
        if not (0 <= s.state_slot < num_slots):
            raise WireError(f"state slot {s.state_slot} out of range")
        if plan.mode == "decode" and s.new_len != 1:
            raise WireError("decode sequences take exactly one token")
        for off, slot in s.captures:
            if not (1 <= off <= s.new_len) or not (0 <= slot < num_slots):
                raise WireError(f"{s.rid}: capture ({off}, {slot}) out of range")

    pages = pages_cpu.to(device=device, dtype=torch.int64)
    # One scatter of every sequence's new pages: a launch per sequence would grow the step with the batch.
    states = tables.update_all(seqs, pages)
    positions, write_slots, seq_slots = [], [], []
    tok = 0
    for s, state in zip(seqs, states, strict=True):
        total = s.prefix_len + s.new_len
        slots = state.token_slots(total)
        seq_slots.append(slots)
        write_slots.append(slots[s.prefix_len :])
        positions.extend(range(s.prefix_len, total))
        if state.penalties is not None:
            state.penalties.feed(input_ids[tok : tok + s.new_len])
        if state.grammar is not None:
            state.grammar.feed(s.prefix_len, ids_cpu[tok : tok + s.new_len])
        tok += s.new_len

    batch = ForwardBatch(
        mode=plan.mode,  # type: ignore[arg-type]
        input_ids=input_ids,
        # Built on the host and copied once: a launch per sequence would make the step grow with the batch.
        positions=host_values(positions, torch.int64, device),
        new_lens=[s.new_len for s in seqs],
        prefix_lens=[s.prefix_len for s in seqs],
        write_slots=torch.cat(write_slots) if write_slots else input_ids.new_empty(0),
        state_slots=host_values([s.state_slot for s in seqs], torch.int64, device),
        # A capture at the very end is a copy of the final state: the worker does it after the forward.
        captures=[[Capture(off, slot) for off, slot in s.captures if off < s.new_len] for s in seqs],
    )
    if plan.mode == "prefill":
        batch.seq_slots = seq_slots
        # The varlen attention's [B, longest context] table: one gather of the sequences' rows.
        batch.prefill_slots = tables.decode_table(states, max(s.prefix_len + s.new_len for s in seqs))
    else:
        lens = [s.prefix_len + 1 for s in seqs]
        batch.slot_table = tables.decode_table(states, max(lens))  # one gather of the sequences' rows
        batch.seq_lens = host_values(lens, torch.int64, device)
    return batch, states


def slots_to_zero(mode: str, seqs: Sequence[SeqPlan]) -> list[int]:
    """The state slots a batch must zero before its forward: those whose sequence starts from zeros
    (`state_init` "zero"), except a prefill's sequences with nothing before them and tokens to run.
    Those never read their slot (the recurrent layers start them from zeros) and every layer writes
    its final state there, so zeroing it first is a pass over every layer's state for nothing
    (about 1 ms of a 512-token prefill of the medium NemotronH on 2 CPU cores)."""
    return [
        s.state_slot
        for s in seqs
        if s.state_init == "zero" and not (mode == "prefill" and s.prefix_len == 0 and s.new_len > 0)
    ]
