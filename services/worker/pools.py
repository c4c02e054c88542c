"""Device pools: the paged attention KV pool and the recurrent (Mamba) state pool.

The worker owns these tensors; which page or slot belongs to whom is decided by the cache
controller's allocators. The pools here are data only: no free lists, no ownership.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from himamba.services.worker.resident_rows import ResidentRows, is_resident_batch

if TYPE_CHECKING:
    from himamba.services.worker.forward_batch import ForwardBatch


@dataclass(frozen=True)
class KVSpec:
    """Shape of the attention KV of one model."""

    num_layers: int  # attention layers only
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize


@dataclass(frozen=True)
class StateComponent:
    """One named tensor of a recurrent layer's state (e.g. Mamba2 'conv' or 'ssm')."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def nbytes(self) -> int:
        return self.numel() * self.dtype.itemsize


@dataclass(frozen=True)
class StateSpec:
    """Shape of the recurrent state of one model: one list of components per recurrent layer."""

    layers: tuple[tuple[StateComponent, ...], ...]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def bytes_per_slot(self) -> int:
        return sum(c.nbytes() for layer in self.layers for c in layer)


class KVPool:
    """Paged KV: token slot `page * page_size + offset` of every attention layer."""

    def __init__(self, spec: KVSpec, num_pages: int, page_size: int, device: torch.device):
        self.spec = spec
        self.page_size = page_size
        self.num_pages = num_pages
        n = num_pages * page_size
        shape = (n, spec.num_kv_heads, spec.head_dim)
        self.k = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        self.v = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]


class StatePool:
    """Recurrent state slots: `tensors[layer][name]` has shape [num_slots, *component.shape].

    A model's recurrent layers get their state through `layer(index, batch)`: at steady decode
    that is the batch's rows kept out of the pool between steps (resident_rows.py); everything
    else sees the pool through `tensors`, which writes those rows back first."""

    def __init__(self, spec: StateSpec, num_slots: int, device: torch.device):
        self.spec = spec
        self.num_slots = num_slots
        self._tensors: list[dict[str, torch.Tensor]] = [
            {c.name: torch.zeros((num_slots, *c.shape), dtype=c.dtype, device=device) for c in layer}
            for layer in spec.layers
        ]
        self._resident: ResidentRows | None = None

    @property
    def tensors(self) -> list[dict[str, torch.Tensor]]:
        """Every layer's pool tensors, up to date."""
        self.write_back()
        return self._tensors

    @property
    def num_layers(self) -> int:
        return len(self._tensors)

    def write_back(self) -> None:
        """Put a decode batch's resident rows back into the pool."""
        if self._resident is not None:
            self._resident.write_back()
            self._resident = None

    def layer(self, index: int, batch: ForwardBatch) -> tuple[ForwardBatch, dict[str, torch.Tensor]]:
        """What recurrent layer `index` reads and writes for `batch`: the batch as the layer must
        see it and its state tensors (the pool's, or the batch's resident rows)."""
        if not is_resident_batch(batch):
            self.write_back()
            return batch, self._tensors[index]
        res = self._resident
        if res is None or res.batch is not batch:
            assert batch.state_slots is not None
            key = batch.state_slots.tolist()
            if res is not None and res.key == key:
                res.use(batch)  # the same sequences a step further: the rows stay
            else:
                self.write_back()
                res = self._resident = ResidentRows(self._tensors, batch, key)
        assert res.view is not None
        return res.view, res.layer(index)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's state from slots `src` to slots `dst` (int64 tensors, same length)."""
        if src.numel() == 0:
            return
        for layer in self.tensors:
            for t in layer.values():
                t.index_copy_(0, dst, t.index_select(0, src))

    def zero(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        for layer in self.tensors:
            for t in layer.values():
                t.index_fill_(0, slots, 0)
