"""Layout of the shared-memory host pools, as plain data (no torch): it travels in WorkerInfo."""

from __future__ import annotations

import msgspec

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


class StateComponentLayout(msgspec.Struct, frozen=True, array_like=True):
    layer: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int  # bytes from the start of a slot


class HostPoolLayout(msgspec.Struct, frozen=True, kw_only=True):
    """Shapes and shared-memory names of the host pools (carried in WorkerInfo)."""

    kv_name: str = ""
    num_pages: int = 0
    page_size: int = 1
    num_kv_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    kv_dtype: str = "float32"
    state_name: str = ""
    num_slots: int = 0
    state_components: list[StateComponentLayout] = []
    state_slot_bytes: int = 0
    # Tensor parallelism: the segments hold every rank's shard of a page (of a slot) side by side, rank
    # after rank; page_bytes and state_slot_bytes are one rank's. A page is one blob for storage either way.
    tp_size: int = 1

    @property
    def page_bytes(self) -> int:
        itemsize = _ITEMSIZE[self.kv_dtype]
        return 2 * self.num_kv_layers * self.page_size * self.num_kv_heads * self.head_dim * itemsize
