"""Device pools: the paged attention KV pool and the recurrent (Mamba) state pool.

The worker owns these tensors; which page or slot belongs to whom is decided by the cache
controller's allocators. The pools here are data only: no free lists, no ownership.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    """Recurrent state slots: `tensors[layer][name]` has shape [num_slots, *component.shape]."""

    def __init__(self, spec: StateSpec, num_slots: int, device: torch.device):
        self.spec = spec
        self.num_slots = num_slots
        self.tensors: list[dict[str, torch.Tensor]] = [
            {c.name: torch.zeros((num_slots, *c.shape), dtype=c.dtype, device=device) for c in layer}
            for layer in spec.layers
        ]

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
