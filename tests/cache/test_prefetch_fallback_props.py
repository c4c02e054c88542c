"""Seed 002's promise as properties (hypothesis), on the real controller and StorageTier with a
synchronous fake I/O layer (a lookup answers the StorageHit the test draws; fetch jobs never end).

For any host pool, host content, pinned host states and storage hit, once a prefetch's lookup is
handled:
  P1  a prefetch that does not start a fetch leaves the host tier exactly as it was (no host page
      and no host state evicted for nothing, e.g. when every host state slot is pinned);
  P2  a fetch that starts ends at a page with a stored state (hybrid), is >= the threshold beyond
      what the tree served, never exceeds the hit, and is truncated only when the whole hit did
      not fit in free + evictable host memory;
  P3  host pages are evicted for it only when the free ones did not suffice;
  P4  check_invariants() holds, and cancelling it releases every pin it took.

HIMAMBA_HYPOTHESIS_EXAMPLES (default 150) sets the number of examples.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import Future

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from himamba.common.config import CacheConfig
from himamba.common.messages import Admit, CancelPrefetch, Prefetch, Release
from himamba.services.cache.controller import CacheController
from himamba.services.cache.storage.base import StorageHit
from himamba.services.cache.storage.io_workers import JobKind, JobOutcome, JobResult

PS = 4
FP = hashlib.sha256(b"props").digest()
EXAMPLES = int(os.environ.get("HIMAMBA_HYPOTHESIS_EXAMPLES", "150"))


class _Stats:
    num_reconnects = 0


class _Backend:
    def stats(self):
        return _Stats()


class _Handle:
    def __init__(self, done: bool, n: int):
        self.future: Future = Future()
        if done:
            self.future.set_result(JobResult(0, JobKind.BACKUP, None, JobOutcome.DONE, n, True, 0, 0, 0.0, 0.0, None))

    def revoke(self):
        pass


class FakeIO:
    """Backups succeed at once; a lookup answers `self.hit`; a prefetch job never finishes."""

    def __init__(self):
        self.backend = _Backend()
        self.hit = StorageHit(0, 0)

    def lookup(self, keys, *, needs_state):
        f: Future = Future()
        f.set_result(self.hit)
        return f

    def submit_backup(self, keys, host_pages, state=None, tag=None):
        return _Handle(True, len(keys))

    def submit_prefetch(self, keys, host_pages, state, tag=None, mid_states=()):
        return _Handle(False, 0)


def _host_snapshot(c):
    t = c.tree
    return (t.usage().host_pages_used, t.usage().host_states_used, c.host_kv.num_free, c.host_state.num_free)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    host_pages=st.integers(2, 24),
    host_slots=st.integers(1, 4),
    others=st.lists(st.integers(2, 5), min_size=0, max_size=6),  # page counts of other cached prompts
    pin_states=st.booleans(),
    prompt_pages=st.integers(2, 16),
    hit_frac=st.floats(0.1, 1.0),
    state_every=st.integers(1, 5),
    thr_pages=st.integers(1, 6),
)
def test_the_prefetch_fallback_keeps_its_promises(
    host_pages, host_slots, others, pin_states, prompt_pages, hit_frac, state_every, thr_pages
):
    cfg = CacheConfig(
        page_size=PS,
        prefetch_threshold=thr_pages * PS,
        hicache_storage_prefetch_policy="wait_complete",
        hicache_write_policy="write_through",
    )
    c = CacheController(cfg, 256, 64, host_pages, host_slots)
    io = FakeIO()
    tier = c.attach_storage(io, FP)
    for i, n in enumerate(others):  # other prefixes on host (write_through backups, acknowledged)
        toks = [1000 * (i + 1) + j for j in range(n * PS + 1)]
        a = c.apply(Admit(rid=f"o{i}", tokens=toks, num_slots=1))
        assert a.ok
        c.apply(Release(rid=f"o{i}", tokens=toks[: n * PS], slot=a.slots[0]))
        c.transfers_done([t.op_id for t in c.take_transfers()])
        c.poll_storage()
    t = c.tree
    pins = []
    if pin_states:  # every host state pinned (as by waiting requests' prefetches)
        stack = [t.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n is not t.root and n.host_state is not None:
                pins.append(t.protect_host(n, kv=False, state=True))
    num = max(1, int(prompt_pages * hit_frac))
    ends = tuple(k for k in range(1, num + 1) if k % state_every == 0 or k == num)
    io.hit = StorageHit(num, num, ends)
    prompt = [7 + j for j in range(prompt_pages * PS + 1)]
    before = _host_snapshot(c)
    free_before, evictable_before = c.host_kv.num_free, t.usage().host_pages_evictable
    c.apply(Prefetch(rid="p", tokens=prompt))
    c.poll_storage()
    c.check_invariants()
    pf = tier.prefetches.get("p")
    started = pf is not None and pf.phase == "fetch"
    if not started:
        assert _host_snapshot(c) == before, (
            f"host changed for a refused prefetch: {before} -> {_host_snapshot(c)}; {dict(tier.counters.outcomes)}"
        )
    else:
        n = len(pf.plan.keys)
        assert n in ends, f"fetch ends at page {n}, which has no stored state ({ends})"
        assert n * PS - pf.base_len >= max(cfg.prefetch_threshold, PS), "fetch below the threshold"
        assert n <= num
        if n < num:
            assert num - pf.first_page > free_before + evictable_before, "truncated although the whole hit fitted"
        evicted = before[0] - t.usage().host_pages_used
        need = n - pf.first_page
        # eviction is by whole nodes, so it may overshoot; it must not happen when free pages sufficed
        assert evicted == 0 or need > free_before, f"evicted {evicted} host pages for {need} with {free_before} free"
    c.apply(CancelPrefetch(rid="p"))
    for p in pins:
        t.release_host(p)
    c.check_invariants()
    if not started:
        assert t.usage().host_pages_protected == 0 and t.usage().host_states_protected == 0
