"""Host pool sizing: each host pool scales its own device pool (by --hicache-ratio, or to share
--hicache-size-gb in the device pools' proportions), explicit sizes win per pool, and host pools
that would not fit in the machine's memory are refused at start with the flags to change."""

from __future__ import annotations

import pytest
import torch

from himamba.common.config import CacheConfig, Config
from himamba.services.worker import memory
from himamba.services.worker.memory import plan_pools
from himamba.services.worker.pools import KVSpec, StateComponent, StateSpec

KV = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)  # 512 B/token, 8 KiB/page
STATE = StateSpec(((StateComponent("ssm", (8, 16, 16), torch.float32),),))  # 8 KiB/slot
NO_STATE = StateSpec(())
CPU = torch.device("cpu")


def _plan(state: StateSpec = STATE, **cache):  # type: ignore[no-untyped-def]
    cache.setdefault("max_total_tokens", 1024)  # 64 pages
    cache.setdefault("max_mamba_cache_size", 32)
    return plan_pools(Config(cache=CacheConfig(**cache)), KV, state, CPU)


def test_ratio_scales_each_pool_from_its_own_device_pool():
    assert (_plan().num_host_pages, _plan().num_host_state_slots) == (128, 64)  # the default ratio, 2
    plan = _plan(hicache_ratio=3.0)
    assert (plan.num_host_pages, plan.num_host_state_slots) == (192, 96)


def test_size_in_gb_is_split_like_the_device_pools():
    page_bytes, slot_bytes = KV.bytes_per_token() * 16, STATE.bytes_per_slot()
    device_bytes = 64 * page_bytes + 32 * slot_bytes
    plan = _plan(hicache_size_gb=10 * device_bytes / 1e9)
    assert (plan.num_host_pages, plan.num_host_state_slots) == (640, 320)
    host_bytes = plan.num_host_pages * page_bytes + plan.num_host_state_slots * slot_bytes
    assert host_bytes == pytest.approx(10 * device_bytes, rel=1e-6)


def test_explicit_counts_win_per_pool():
    plan = _plan(hicache_size_gb=1.0, hicache_tokens=160, hicache_mamba_slots=5)
    assert (plan.num_host_pages, plan.num_host_state_slots) == (10, 5)
    plan = _plan(hicache_ratio=3.0, hicache_mamba_slots=5)
    assert (plan.num_host_pages, plan.num_host_state_slots) == (192, 5)


def test_a_model_without_recurrent_layers_gets_no_host_state_slots():
    plan = _plan(NO_STATE, hicache_size_gb=2 * 64 * KV.bytes_per_token() * 16 / 1e9)
    assert (plan.num_host_pages, plan.num_host_state_slots) == (128, 0)


def test_host_pools_larger_than_the_machine_are_refused_with_the_flags(monkeypatch):
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 1_000_000)
    with pytest.raises(ValueError, match="hicache-ratio") as e:
        _plan(hicache_ratio=4.0)  # 256 pages + 128 slots = 3 MiB > 0.9 MB
    assert "available" in str(e.value)
    assert _plan(enable_hierarchical_cache=False).num_host_pages == 0  # no host tier: nothing to check


def test_host_pools_larger_than_dev_shm_are_refused_naming_the_fix(monkeypatch):
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 1 << 40)
    monkeypatch.setattr(memory, "shm_free_bytes", lambda: 64_000_000)  # a container's default 64 MB
    with pytest.raises(ValueError, match="/dev/shm has 0.06 GB free") as e:
        _plan(hicache_size_gb=0.1)
    assert "--shm-size=" in str(e.value) and "--hicache-ratio" in str(e.value)
    assert _plan(hicache_size_gb=0.05).num_host_pages > 0  # fits: served
    assert _plan(enable_hierarchical_cache=False).num_host_pages == 0


def test_dev_shm_free_space_is_read_from_the_filesystem():
    import os

    st = os.statvfs("/dev/shm")
    assert memory.shm_free_bytes() == st.f_bavail * st.f_frsize


def test_memory_fraction_of_free_or_of_total():
    """Ours: a share of what is free after the weights. sglang's --mem-fraction-static (of total):
    the process stays under that share of total memory, the pools get what is left under it."""
    from himamba.common.config import CacheConfig
    from himamba.services.worker.memory import pool_budget

    gib = 1 << 30
    assert pool_budget(CacheConfig(memory_fraction=0.25), free=60 * gib, total=80 * gib) == 15 * gib
    total = CacheConfig(memory_fraction=0.9, memory_fraction_of="total")
    # 80 GiB device, 20 GiB taken (weights, other processes): 72 GiB allowed, 52 GiB left for pools.
    assert pool_budget(total, free=60 * gib, total=80 * gib) == 60 * gib - int(80 * gib * (1 - 0.9))
    assert pool_budget(total, free=5 * gib, total=80 * gib) == 0  # already over the share: nothing
