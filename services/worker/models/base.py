"""The contract every model file implements, so the worker can run any hybrid family."""

from __future__ import annotations

from typing import Iterable, Protocol

import torch

from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.pools import KVPool, KVSpec, StatePool, StateSpec


class HybridModel(Protocol):
    """A causal LM mixing attention layers (paged KV) and recurrent layers (state slots).

    `forward` reads and writes the pools in place: new K/V go to `batch.write_slots`; each
    sequence's recurrent state is read from `batch.state_slots[i]` as the initial state and
    the final state is written back there; `batch.captures[i]` asks for copies of the state
    at intermediate offsets. It returns the logits of each sequence's last new token, [B, V].
    """

    vocab_size: int

    def kv_spec(self) -> KVSpec: ...

    def state_spec(self) -> StateSpec: ...

    def forward(self, batch: ForwardBatch, kv: KVPool, state: StatePool) -> torch.Tensor: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...
