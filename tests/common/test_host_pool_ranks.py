"""Host pools under tensor parallelism: rank 0 creates room for every rank's shard of a page and a slot,
each rank maps its own, and the controller's view holds whole pages (rank after rank) for storage."""

from __future__ import annotations

import os

import torch

from himamba.common.host_layout import HostPoolLayout, StateComponentLayout
from himamba.common.host_pool import open_host_pools


def _layout(tp: int) -> HostPoolLayout:
    tag = f"himamba-{os.getpid()}-tptest{tp}"
    return HostPoolLayout(
        kv_name=f"{tag}-kv", num_pages=3, page_size=2, num_kv_layers=1, num_kv_heads=1, head_dim=2,
        kv_dtype="float32", state_name=f"{tag}-state", num_slots=2,
        state_components=[StateComponentLayout(0, "ssm", (2,), "float32", 0)], state_slot_bytes=8, tp_size=tp,
    )  # fmt: skip


def test_each_rank_maps_its_shard_and_the_controller_whole_pages():
    layout = _layout(2)
    rank0 = open_host_pools(layout, create=True, rank=0)
    rank1 = open_host_pools(layout, create=False, rank=1)
    whole = open_host_pools(layout, create=False, rank=None)
    try:
        assert rank0.kv is not None and rank1.kv is not None
        assert rank0.kv.shape == (3, 1, 2, 2, 1, 2) and rank0.kv_bytes.shape == (3, layout.page_bytes)
        rank0.kv[1] = 1.0
        rank1.kv[1] = 2.0
        rank0.state[(0, "ssm")][0] = 3.0
        rank1.state[(0, "ssm")][0] = 4.0
        assert whole.kv is None and whole.state == {}  # bytes only: what storage moves
        assert whole.kv_bytes is not None and whole.kv_bytes.shape == (3, 2 * layout.page_bytes)
        page = whole.kv_bytes[1].view(torch.float32)
        assert page[:8].eq(1.0).all() and page[8:].eq(2.0).all()
        assert whole.state_bytes is not None and whole.state_bytes[0].view(torch.float32).tolist() == [3, 3, 4, 4]
        assert rank0.kv[0].eq(0).all() and rank1.kv[2].eq(0).all()  # other pages untouched
    finally:
        for pools in (whole, rank1):
            pools.close()
        rank0.close(unlink=True)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"himamba-{os.getpid()}-tptest")]


def test_one_rank_is_the_plain_layout():
    layout = _layout(1)
    pools = open_host_pools(layout, create=True)
    try:
        assert pools.kv is not None and pools.kv.is_contiguous() and pools.kv_bytes.shape == (3, layout.page_bytes)
        assert pools.state[(0, "ssm")].shape == (2, 2)
    finally:
        pools.close(unlink=True)
