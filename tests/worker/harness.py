"""A minimal stand-in for the worker's runner: pools, page/slot allocation and ForwardBatch building.

Drives a `HybridModel` the way the runner will: prefill batches of several sequences (each
extending its cached prefix), then one-token decode steps, with the KV pool paged (pages handed
out in a shuffled order so a sequence's slots are not contiguous) and one state slot per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from himamba.services.worker.forward_batch import Capture, ForwardBatch
from himamba.services.worker.models.base import HybridModel
from himamba.services.worker.pools import KVPool, StatePool


@dataclass
class Sequence:
    """A sequence's pool resources and how many of its tokens are in the pools."""

    state_slot: int
    pages: list[int] = field(default_factory=list)
    length: int = 0


class Harness:
    """Owns a model's KV and state pools and turns token lists into ForwardBatches."""

    def __init__(
        self,
        model: HybridModel,
        *,
        page_size: int = 16,
        num_pages: int = 256,
        num_state_slots: int = 32,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.page_size = page_size
        self.kv = KVPool(model.kv_spec(), num_pages, page_size, self.device)
        self.state = StatePool(model.state_spec(), num_state_slots, self.device)
        gen = torch.Generator().manual_seed(seed)
        self._free_pages: list[int] = torch.randperm(num_pages, generator=gen).tolist()
        self._free_slots: list[int] = torch.randperm(num_state_slots, generator=gen).tolist()

    def alloc_state_slot(self) -> int:
        """A free state slot (for a new sequence or a capture target)."""
        if not self._free_slots:
            raise RuntimeError("harness ran out of state slots")
        return self._free_slots.pop()

    def new_sequence(self) -> Sequence:
        """An empty sequence with its own state slot; pages are taken as it grows."""
        return Sequence(state_slot=self.alloc_state_slot())

    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        """Copy every recurrent layer's state from one slot to another."""
        self.state.copy(self._tensor([src_slot]), self._tensor([dst_slot]))

    def read_state(self, slot: int) -> list[dict[str, torch.Tensor]]:
        """A copy of every recurrent layer's state in `slot`."""
        return [{name: t[slot].clone() for name, t in layer.items()} for layer in self.state.tensors]

    def _take_page(self) -> int:
        if not self._free_pages:
            raise RuntimeError("harness ran out of KV pages")
        return self._free_pages.pop()

    def token_slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """KV-pool token slots of positions [start, end) of `seq`, allocating pages as needed."""
        while len(seq.pages) * self.page_size < end:
            seq.pages.append(self._take_page())
        return [seq.pages[p // self.page_size] * self.page_size + p % self.page_size for p in range(start, end)]

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def prefill(
        self,
        seqs: list[Sequence],
        new_tokens: list[list[int]],
        captures: list[list[Capture]] | None = None,
    ) -> torch.Tensor:
        """Extend each sequence by its new tokens in one prefill batch; logits [B, V] of their last tokens."""
        ids, positions, write, seq_slots = [], [], [], []
        for seq, toks in zip(seqs, new_tokens, strict=True):
            start, end = seq.length, seq.length + len(toks)
            ids += toks
            positions += range(start, end)
            write += self.token_slots(seq, start, end)
            seq_slots.append(self._tensor(self.token_slots(seq, 0, end)))
        batch = ForwardBatch(
            mode="prefill",
            input_ids=self._tensor(ids),
            positions=self._tensor(positions),
            new_lens=[len(t) for t in new_tokens],
            prefix_lens=[s.length for s in seqs],
            write_slots=self._tensor(write),
            seq_slots=seq_slots,
            state_slots=self._tensor([s.state_slot for s in seqs]),
            captures=captures if captures is not None else [[] for _ in seqs],
        )
        logits = self.model.forward(batch, self.kv, self.state)
        for seq, toks in zip(seqs, new_tokens, strict=True):
            seq.length += len(toks)
        return logits

    def decode(self, seqs: list[Sequence], tokens: list[int]) -> torch.Tensor:
        """Append one token to each sequence in one decode batch; logits [B, V]."""
        max_len = max(s.length for s in seqs) + 1
        table = torch.zeros(len(seqs), max_len, dtype=torch.int64)
        write = []
        for i, seq in enumerate(seqs):
            slots = self.token_slots(seq, 0, seq.length + 1)
            table[i, : len(slots)] = torch.tensor(slots)
            write.append(slots[-1])
        batch = ForwardBatch(
            mode="decode",
            input_ids=self._tensor(tokens),
            positions=self._tensor([s.length for s in seqs]),
            new_lens=[1] * len(seqs),
            prefix_lens=[s.length for s in seqs],
            write_slots=self._tensor(write),
            slot_table=table.to(self.device),
            seq_lens=self._tensor([s.length + 1 for s in seqs]),
            state_slots=self._tensor([s.state_slot for s in seqs]),
        )
        logits = self.model.forward(batch, self.kv, self.state)
        for seq in seqs:
            seq.length += 1
        return logits

    def generate_greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Prefill all prompts together, then decode them together; the greedy new tokens of each."""
        seqs = [self.new_sequence() for _ in prompts]
        logits = self.prefill(seqs, prompts)
        out: list[list[int]] = [[] for _ in prompts]
        for step in range(max_new_tokens):
            next_ids = logits.argmax(-1).tolist()
            for o, t in zip(out, next_ids, strict=True):
                o.append(t)
            if step + 1 < max_new_tokens:
                logits = self.decode(seqs, next_ids)
        return out
