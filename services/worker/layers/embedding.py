"""Token embedding and the LM head (logits of selected rows only)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from himamba.services.worker.layers.cpu_packing import Packed, can_pack, pack, packed_linear
from himamba.services.worker.tensor_parallel import all_gather_last, group, mark, split


class VocabEmbedding(nn.Module):
    """Lookup table [vocab, hidden]; `multiplier` scales the output (Granite's embedding_multiplier)."""

    def __init__(
        self, vocab_size: int, hidden_size: int, device: torch.device, dtype: torch.dtype, multiplier: float = 1.0
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.multiplier = multiplier
        self.weight = nn.Parameter(
            torch.empty(vocab_size, hidden_size, device=device, dtype=dtype), requires_grad=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dtype != torch.int64 or input_ids.dim() != 1:
            raise ValueError(f"input_ids must be a 1-d int64 tensor, got {input_ids.dtype} {tuple(input_ids.shape)}")
        out = F.embedding(input_ids, self.weight)
        if self.multiplier != 1.0:
            out = out * self.multiplier
        return out


class LMHead(nn.Module):
    """Float32 logits `hidden @ weight.T / logits_divisor` for the rows it is given.

    Callers pass only the rows whose logits are needed (each sequence's last token), so the
    [T, vocab] product of a long prefill is never formed. With `tied_to`, the head reuses the
    embedding table and owns no parameter (its checkpoint entry, if any, is not needed).

    Under tensor parallelism an untied head whose vocabulary divides by N is vocab-parallel: each rank
    computes its share of the logits and every rank gets all of them (one all-gather). The embedding
    table is replicated (a lookup costs nothing to repeat), and so is a head tied to it.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        device: torch.device,
        dtype: torch.dtype,
        tied_to: VocabEmbedding | None = None,
        logits_divisor: float = 1.0,
    ) -> None:
        super().__init__()
        self.logits_divisor = logits_divisor
        # A tuple keeps the tied embedding out of this module's registered children (and names).
        self._tied = (tied_to,) if tied_to is not None else ()
        self.vocab_parallel = tied_to is None and group().size > 1 and vocab_size % group().size == 0
        rows = vocab_size // group().size if self.vocab_parallel else vocab_size
        self.weight = (
            None
            if tied_to is not None
            else nn.Parameter(torch.empty(rows, hidden_size, device=device, dtype=dtype), requires_grad=False)
        )
        if self.vocab_parallel:
            mark(self.weight, split(0))
        self._packed: Packed | None = None  # packed copy of the matrix (cpu_packing); not a parameter

    @property
    def is_tied(self) -> bool:
        return bool(self._tied)

    def tie_to(self, embedding: VocabEmbedding) -> None:
        """Drop this head's own matrix and read the embedding table from now on."""
        self._tied = (embedding,)
        self.weight = None
        self.vocab_parallel = False
        self._packed = None

    def pack_for_cpu(self) -> bool:
        """Use a pre-packed copy (cpu_packing) of the head's matrix (its own or the tied embedding's) from now
        on, where it applies; True if packed."""
        weight = self._tied[0].weight if self._tied else self.weight
        assert weight is not None
        self._packed = pack(weight) if can_pack(weight) else None
        return self._packed is not None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self._tied[0].weight if self._tied else self.weight
        if self._packed is not None:
            logits = packed_linear(hidden, self._packed, None).float()
        else:
            logits = F.linear(hidden, weight).float()
        if self.vocab_parallel:
            logits = all_gather_last(logits)
        if self.logits_divisor != 1.0:
            logits = logits / self.logits_divisor
        return logits
