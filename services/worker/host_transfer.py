"""Device <-> host copies of KV pages and recurrent states, as ordered by the cache controller.

The host pools are shared-memory views (common/host_pool.py). On CUDA the host side is a
plain (not pinned) mapping; copies are synchronous on the worker's stream, which keeps the
ordering guarantee the cache controller relies on: an order runs before any later forward.
"""

from __future__ import annotations

import os

import torch

from himamba.common.host_layout import HostPoolLayout, StateComponentLayout
from himamba.common.host_pool import HostPools, open_host_pools
from himamba.common.messages import Transfer
from himamba.services.worker.pools import KVPool, StatePool

_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def host_layout(kv: KVPool, state: StatePool, num_pages: int, num_slots: int) -> HostPoolLayout:
    """The shared-memory layout matching the device pools (names unique to this process)."""
    comps = []
    offset = 0
    for li, layer in enumerate(state.spec.layers):
        for c in layer:
            comps.append(StateComponentLayout(li, c.name, tuple(c.shape), _NAMES[c.dtype], offset))
            offset += -(-c.nbytes() // 8) * 8  # keep every component 8-byte aligned
    tag = f"himamba-{os.getpid()}-{id(kv) & 0xFFFF:x}"
    return HostPoolLayout(
        kv_name=f"{tag}-kv" if num_pages else "",
        num_pages=num_pages,
        page_size=kv.page_size,
        num_kv_layers=kv.spec.num_layers,
        num_kv_heads=kv.spec.num_kv_heads,
        head_dim=kv.spec.head_dim,
        kv_dtype=_NAMES[kv.spec.dtype],
        state_name=f"{tag}-state" if num_slots else "",
        num_slots=num_slots,
        state_components=comps,
        state_slot_bytes=max(offset, 8),
    )


class HostTransfer:
    """Executes Transfer orders between the device pools and the shared host pools."""

    def __init__(self, kv: KVPool, state: StatePool, layout: HostPoolLayout, device: torch.device):
        self.device = device
        self.kv = kv
        self.state = state
        self.layout = layout
        self.host: HostPools = open_host_pools(layout, create=True)

    def close(self) -> None:
        self.host.close(unlink=True)

    def _token_slots(self, pages: list[int]) -> torch.Tensor:
        ps = self.kv.page_size
        p = torch.tensor(pages, dtype=torch.int64, device=self.device)
        return (p.view(-1, 1) * ps + torch.arange(ps, device=p.device)).view(-1)

    def run(self, t: Transfer) -> None:
        if len(t.kv_src) != len(t.kv_dst) or len(t.state_src) != len(t.state_dst):
            raise ValueError(f"transfer {t.op_id}: source and destination lengths differ")
        if t.direction == "d2h":
            self._kv_d2h(t.kv_src, t.kv_dst)
            self._state_copy(t.state_src, t.state_dst, to_host=True)
        else:
            self._kv_h2d(t.kv_src, t.kv_dst)
            self._state_copy(t.state_src, t.state_dst, to_host=False)

    def _kv_d2h(self, dev_pages: list[int], host_pages: list[int]) -> None:
        if not dev_pages:
            return
        assert self.host.kv is not None
        slots = self._token_slots(dev_pages)
        hidx = torch.tensor(host_pages, dtype=torch.int64)
        n, ps = len(dev_pages), self.kv.page_size
        for layer, (k, v) in enumerate(zip(self.kv.k, self.kv.v)):
            self.host.kv[hidx, layer, 0] = k.index_select(0, slots).view(n, ps, *k.shape[1:]).cpu()
            self.host.kv[hidx, layer, 1] = v.index_select(0, slots).view(n, ps, *v.shape[1:]).cpu()

    def _kv_h2d(self, host_pages: list[int], dev_pages: list[int]) -> None:
        if not dev_pages:
            return
        assert self.host.kv is not None
        slots = self._token_slots(dev_pages)
        hidx = torch.tensor(host_pages, dtype=torch.int64)
        for layer, (k, v) in enumerate(zip(self.kv.k, self.kv.v)):
            k.index_copy_(0, slots, self.host.kv[hidx, layer, 0].reshape(-1, *k.shape[1:]).to(k.device))
            v.index_copy_(0, slots, self.host.kv[hidx, layer, 1].reshape(-1, *v.shape[1:]).to(v.device))

    def _state_copy(self, src: list[int], dst: list[int], to_host: bool) -> None:
        if not src:
            return
        dev_idx = torch.tensor(src if to_host else dst, dtype=torch.int64, device=self.device)
        host_idx = torch.tensor(dst if to_host else src, dtype=torch.int64)
        for li, layer in enumerate(self.state.tensors):
            for name, dev in layer.items():
                host = self.host.state[(li, name)]
                if to_host:
                    host[host_idx] = dev.index_select(0, dev_idx).cpu()
                else:
                    dev.index_copy_(0, dev_idx, host[host_idx].to(dev.device))
