"""The tensors of one forward pass, built by the runner and read by the model layers.

A batch is either all-prefill (each sequence extends its cached prefix by one or more
new tokens) or all-decode (each sequence adds exactly one token). Tokens of all sequences
are concatenated along one axis `T`; per-sequence views are given by `new_lens`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch

from himamba.kernels import Varlen, make_varlen


class Capture(NamedTuple):
    """Copy a sequence's recurrent state, as it is after `offset` of its new tokens, into `slot`.

    `offset` is counted within this forward's new tokens (1..new_len). The tree only keeps
    states at page-aligned prefix lengths, so a prefill that must checkpoint mid-way (a branch
    point, the last whole page of a prompt, a chunk end) asks for a capture there.
    """

    offset: int
    slot: int


@dataclass
class ForwardBatch:
    """Everything a model needs for one forward, besides the weights and the pools."""

    mode: Literal["prefill", "decode"]
    input_ids: torch.Tensor  # [T] int64, new tokens of every sequence, concatenated
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    new_lens: list[int]  # [B] new tokens per sequence (1 for every sequence in decode)
    prefix_lens: list[int]  # [B] tokens whose KV is already in the pool (and state in the slot)
    write_slots: torch.Tensor  # [T] int64, KV-pool token slot where each new token's K/V go
    # Prefill: per sequence, the token slots of its whole context (prefix + new), in order.
    seq_slots: list[torch.Tensor] = field(default_factory=list)
    # Prefill: the same as one [B, >= longest context] table (row b: sequence b's token slots), what the
    # varlen attention reads; None: built from seq_slots on first use (`prefill_table`).
    prefill_slots: torch.Tensor | None = None
    # Decode: token-slot table [B, max_len] (padded with 0) and context lengths [B] incl. new token.
    slot_table: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    # Recurrent state slot of each sequence: read as the initial state, overwritten with the final.
    state_slots: torch.Tensor | None = None  # [B] int64
    captures: list[list[Capture]] = field(default_factory=list)  # [B] lists (may be empty)
    # Indices into T of the rows whose logits the model returns; None: each sequence's last
    # new token (`last_token_index`). Set for prompt logprobs (worker/logprobs.py).
    logit_rows: torch.Tensor | None = None
    # Torch threads the vocabulary head runs on (None: the step's); see worker/step_threads.py.
    head_threads: int | None = None

    _varlen: Varlen | None = field(default=None, init=False, repr=False)

    @property
    def varlen(self) -> Varlen:
        """The prefill's layout for the varlen kernels (cu_seqlens, prefixes, captures), built on the
        host and copied to the device once per batch, on first use."""
        if self._varlen is None:
            caps = [[(c.offset, c.slot) for c in seq] for seq in self.captures] if self.captures else []
            self._varlen = make_varlen(self.new_lens, self.prefix_lens, caps, self.input_ids.device)
        return self._varlen

    @property
    def prefill_table(self) -> torch.Tensor:
        """[B, longest context] token slots of a prefill's sequences (`prefill_slots`, or seq_slots padded)."""
        if self.prefill_slots is None:
            self.prefill_slots = torch.nn.utils.rnn.pad_sequence(self.seq_slots, batch_first=True)
        return self.prefill_slots

    @property
    def num_seqs(self) -> int:
        return len(self.new_lens)

    @property
    def last_token_index(self) -> torch.Tensor:
        """[B] index into T of each sequence's last new token (where logits are taken)."""
        ends = torch.tensor(self.new_lens, dtype=torch.int64).cumsum(0)
        return ends - 1
