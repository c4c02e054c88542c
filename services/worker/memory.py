"""How many KV pages and state slots the device pools get.

Explicit sizes from the config win. Otherwise a fraction of the free memory is split between
KV and recurrent state, capped at what the scheduler could ever use, so a tiny model on a big
machine does not reserve gigabytes for nothing.
"""

from __future__ import annotations

import os

from typing import NamedTuple

import torch

from himamba.common.config import CacheConfig, Config
from himamba.services.worker.pools import KVSpec, StateSpec


class PoolPlan(NamedTuple):
    num_pages: int
    num_state_slots: int
    num_host_pages: int
    num_host_state_slots: int
    budget_bytes: int


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def total_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        _, total = torch.cuda.mem_get_info(device)
        return int(total)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return free_memory_bytes(device)


def pool_budget(c: CacheConfig, free: int, total: int) -> int:
    """Bytes the device pools may take. `memory_fraction_of = "free"`: that share of what is free
    once the weights are loaded. "total" (sglang's --mem-fraction-static): the whole process stays
    under that share of total memory, so the pools get what is free above the rest's share."""
    if c.memory_fraction_of == "total":
        return max(0, free - int(total * (1 - c.memory_fraction)))
    return int(free * c.memory_fraction)


def plan_pools(cfg: Config, kv: KVSpec, state: StateSpec, device: torch.device) -> PoolPlan:
    c, s = cfg.cache, cfg.scheduler
    budget = pool_budget(c, free_memory_bytes(device), total_memory_bytes(device))
    # The most any workload can use: every running request at full context, twice over for cache.
    max_useful_pages = 2 * s.max_running_requests * cfg.model.max_context_len // c.page_size + 1
    max_useful_slots = 8 * s.max_running_requests
    state_bytes = max(state.bytes_per_slot(), 1)
    kv_page_bytes = max(kv.bytes_per_token() * c.page_size, 1)
    if c.max_total_tokens:
        pages = -(-c.max_total_tokens // c.page_size)
    else:
        pages = min(max_useful_pages, int(budget * 0.6) // kv_page_bytes)
    if c.max_mamba_cache_size:
        slots = c.max_mamba_cache_size
    elif state.num_layers == 0:
        slots = s.max_running_requests + 1  # pure-attention model: slots are bookkeeping only
    else:
        slots = min(max_useful_slots, int(budget * 0.4) // state_bytes)
    pages, slots = max(pages, 1), max(slots, 1)
    host_pages = host_slots = 0
    if c.enable_hierarchical_cache and not c.disable_radix_cache:
        recurrent = state.num_layers > 0  # else the state pool is bookkeeping only: nothing on host
        host_pages, host_slots = host_sizes(c, pages, slots if recurrent else 0, kv_page_bytes, state_bytes)
        host_bytes = host_pages * kv_page_bytes + host_slots * state_bytes
        check_host_fits(host_bytes, host_memory_bytes())
        check_shm_fits(host_bytes, shm_free_bytes())
    return PoolPlan(pages, slots, host_pages, host_slots, budget)


def host_sizes(c: CacheConfig, pages: int, slots: int, page_bytes: int, slot_bytes: int) -> tuple[int, int]:
    """Host pages and state slots. Each host pool is sized from its own device pool (a Mamba state
    is worth thousands of tokens of KV: giving both pools one size wastes memory, sglang #29034):
    by `hicache_ratio`, or to share `hicache_size_gb` in the device pools' proportions; an explicit
    count wins for its pool."""
    if c.hicache_size_gb:
        host_total, device_total = round(c.hicache_size_gb * 1e9), pages * page_bytes + slots * slot_bytes
    else:  # integer arithmetic, so a ratio of 3 gives exactly three times the device pool
        host_total, device_total = round(c.hicache_ratio * 1_000_000), 1_000_000
    host_pages = -(-c.hicache_tokens // c.page_size) if c.hicache_tokens else pages * host_total // device_total
    host_slots = (c.hicache_mamba_slots or slots * host_total // device_total) if slots else 0
    return host_pages, host_slots


def host_memory_bytes() -> int:
    """Memory the host can still give (MemAvailable); a large number when it cannot be read."""
    return free_memory_bytes(torch.device("cpu"))


def check_host_fits(host_bytes: int, available: int) -> None:
    """Refuse host pools that would take more than 90% of the available memory: the shared-memory
    pools would be killed by the OOM killer later, mid-serving, instead of failing now."""
    if host_bytes > 0.9 * available:
        raise ValueError(
            f"the host cache pools need {host_bytes / 1e9:.2f} GB but only {available / 1e9:.2f} GB of memory is "
            "available; lower --hicache-ratio or --hicache-size-gb (or --hicache-tokens / --hicache-mamba-slots), "
            "or --no-enable-hierarchical-cache"
        )


SHM_DIR = "/dev/shm"


def shm_free_bytes() -> int:
    """Free bytes of the tmpfs the host pools live in (common/host_pool.py's shared memory); a large
    number when it cannot be read."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 1 << 62
    return st.f_bavail * st.f_frsize


def check_shm_fits(host_bytes: int, shm_free: int) -> None:
    """Refuse host pools larger than /dev/shm has free. A container's /dev/shm is 64 MB unless it
    is given more; a pool larger than that maps fine and then SIGBUSes the worker on first touch."""
    if host_bytes > shm_free:
        raise ValueError(
            f"the host cache pools need {host_bytes / 1e9:.2f} GB of shared memory but {SHM_DIR} has "
            f"{shm_free / 1e9:.2f} GB free; give it more (docker run --shm-size={-(-host_bytes // 2**30) + 1}g, or a "
            "memory-backed emptyDir at /dev/shm on Kubernetes) or lower --hicache-ratio / --hicache-size-gb"
        )
