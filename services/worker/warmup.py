"""Start-up warm-up: the prefill kernels compiled before the server says ready, not on the first requests.

On CUDA each Triton twin compiles per specialization (constexprs such as an initial state or not, and
whether integer arguments divide by 16) the first time a forward meets it, which costs the first
requests seconds. Three prefills through the scratch page and state slot (decode_graphs.Scratch) meet
the common ones: one token from nothing, a whole page from nothing, and a page continuing a prefix.
Decode's kernels are compiled by the CUDA-graph capture (or on the first step when graphs are off)."""

from __future__ import annotations

import time

import torch

from himamba.services.worker.decode_graphs import Scratch
from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.models.base import HybridModel
from himamba.services.worker.pools import KVPool, StatePool


def warm_up_prefill(
    model: HybridModel, kv: KVPool, state: StatePool, scratch: Scratch, page_size: int, device: torch.device
) -> float:
    """Run the warm-up prefills; returns the seconds they took. Leaves the scratch slot zeroed."""
    t0 = time.perf_counter()
    slot = torch.tensor([scratch.state_slot], dtype=torch.int64, device=device)
    for prefix, new in ((0, 1), (0, page_size), (1, page_size - 1)):
        total = prefix + new
        slots = torch.arange(scratch.token_slot, scratch.token_slot + total, device=device)
        batch = ForwardBatch(
            mode="prefill",
            input_ids=torch.zeros(new, dtype=torch.int64, device=device),
            positions=torch.arange(prefix, total, device=device),
            new_lens=[new],
            prefix_lens=[prefix],
            write_slots=slots[prefix:],
            seq_slots=[slots],
            state_slots=slot,
            captures=[[]],
        )
        model.forward(batch, kv, state)
    state.zero(slot)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0
