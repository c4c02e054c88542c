"""The storage tier wired into the cache controller: page keys on nodes, backup after the host
copy is acknowledged, prefetch with finalisation under the three policies, adaptive truncation,
failures, and restart (a new controller on the same store). A fake worker moves real bytes
between byte pools, so what comes back from storage is checked byte for byte."""

from __future__ import annotations

import hashlib
import time

import pytest
import torch

from himamba.common.config import CacheConfig
from himamba.common.messages import Admit, CancelPrefetch, Insert, Prefetch, Release
from himamba.services.cache.allocator import PageAllocator, SlotAllocator
from himamba.services.cache.controller import CacheController
from himamba.services.cache.keys import page_keys
from himamba.services.cache.storage.base import HEADER_BYTES
from himamba.services.cache.storage.file import FileBackend
from himamba.services.cache.storage.flaky import FlakyBackend
from himamba.services.cache.storage.io_workers import StorageIO
from himamba.services.cache.storage_tier import PrefetchPlan
from himamba.services.cache.tree.radix_tree import RadixTree

PS = 4
PAGE_BYTES = 64
SLOT_BYTES = 32
FP = hashlib.sha256(b"test model").digest()


def _content(tokens: list[int], nbytes: int) -> torch.Tensor:
    """What a page (or a state) computed over exactly `tokens` holds."""
    d = hashlib.sha256(repr(tuple(tokens)).encode()).digest()
    return torch.tensor(list((d * (nbytes // len(d) + 1))[:nbytes]), dtype=torch.uint8)


class Rig:
    """A controller, its storage tier on a FileBackend, and a fake worker with byte pools."""

    def __init__(self, store, *, host_pages=64, host_slots=16, backend=None, **cfg):
        cfg.setdefault("prefetch_threshold", 2 * PS)
        self.ctrl = CacheController(CacheConfig(page_size=PS, hicache_storage_backend="file", **cfg), 64, 16, host_pages, host_slots)
        self.dev_kv = torch.zeros(64, PAGE_BYTES, dtype=torch.uint8)
        self.dev_state = torch.zeros(16, SLOT_BYTES, dtype=torch.uint8)
        self.host_kv = torch.zeros(host_pages, PAGE_BYTES, dtype=torch.uint8)
        self.host_state = torch.zeros(host_slots, SLOT_BYTES, dtype=torch.uint8)
        self.backend = backend or FileBackend(FP, store)
        self.io = StorageIO(self.backend, self.host_kv, self.host_state, page_size=PS, prefetch_budget_tokens=1024, batch_pages=2)
        self.tier = self.ctrl.attach_storage(self.io, FP)
        assert self.tier is not None

    def run_transfers(self) -> None:
        ts = self.ctrl.take_transfers()
        for t in ts:
            src_kv, dst_kv = (self.dev_kv, self.host_kv) if t.direction == "d2h" else (self.host_kv, self.dev_kv)
            src_st, dst_st = (self.dev_state, self.host_state) if t.direction == "d2h" else (self.host_state, self.dev_state)
            for s, d in zip(t.kv_src, t.kv_dst):
                dst_kv[d] = src_kv[s]
            for s, d in zip(t.state_src, t.state_dst):
                dst_st[d] = src_st[s]
        self.ctrl.transfers_done([t.op_id for t in ts])

    def serve(self, rid: str, tokens: list[int], prefetch: bool = True, max_wait_s: float = 10.0):
        """Prefetch + admit (retrying while prefetching), 'prefill', release; returns Admitted."""
        if prefetch:
            self.ctrl.apply(Prefetch(rid=rid, tokens=tokens))
        deadline = time.monotonic() + max_wait_s
        while True:
            res = self.ctrl.admit(Admit(rid=rid, tokens=tokens, num_slots=1))
            if not res.prefetching:
                break
            assert time.monotonic() < deadline, "a prefetch stalled its request"
            time.sleep(0.005)
        assert res.ok, res.reason
        self.run_transfers()
        # The cached prefix must hold exactly what computing it would have produced.
        for i in range(res.cached_len // PS):
            assert torch.equal(self.dev_kv[res.pages[i]], _content(tokens[: (i + 1) * PS], PAGE_BYTES)), f"page {i}"
        if res.cached_len:
            assert torch.equal(self.dev_state[res.state_src], _content(tokens[: res.cached_len], SLOT_BYTES))
        for i in range(res.cached_len // PS, len(tokens) // PS):
            self.dev_kv[res.pages[i]] = _content(tokens[: (i + 1) * PS], PAGE_BYTES)
        for pos, slot in res.captures:
            self.dev_state[slot] = _content(tokens[:pos], SLOT_BYTES)
            self.ctrl.insert(Insert(rid=rid, tokens=tokens[:pos], slot=slot))
            self.run_transfers()
        self.ctrl.release(Release(rid=rid, tokens=tokens[: len(tokens) // PS * PS]))
        self.run_transfers()
        self.ctrl.check_invariants()
        return res

    def drain(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.tier.busy:
            assert time.monotonic() < deadline, "storage jobs never finished"
            time.sleep(0.005)
            self.ctrl.poll_storage()
        self.ctrl.check_invariants()
        t = self.ctrl.tree
        assert t.usage().host_pages_protected == 0 and t.usage().host_states_protected == 0

    def close(self) -> None:
        self.tier.close()


def _prompt(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(n)]


def test_backup_after_host_ack_stores_keys_and_releases_pins(tmp_path):
    rig = Rig(tmp_path)
    toks = _prompt(26, 1)  # 6 whole pages, state captured at 24
    rig.serve("a", toks)
    rig.drain()
    keys = page_keys(None, toks[:24], PS, FP)
    assert rig.backend.exists(keys) == 6
    assert rig.backend.exists_states(keys)[-1]
    # Node keys are the chained page keys, also after a split at a page boundary.
    rig.serve("b", toks[:8] + [7, 7, 7, 7, 7, 7, 7, 7, 7])
    node = rig.ctrl.tree.match_prefix_host(toks[:8])
    assert node is not None and rig.tier.keys_of(node) == keys[:2]
    rig.close()


@pytest.mark.parametrize("extra", [-1, 0, 1])
def test_restart_serves_the_prefix_from_storage_byte_for_byte(tmp_path, extra):
    first = Rig(tmp_path, hicache_storage_prefetch_policy="wait_complete")
    toks = _prompt(25 + extra, 2)  # the prompt ends on a page boundary, or one token either side
    first.serve("a", toks)
    first.drain()
    first.close()
    second = Rig(tmp_path, hicache_storage_prefetch_policy="wait_complete")
    nxt = toks + _prompt(9, 3)
    res = second.serve("b", nxt)
    assert res.cached.storage > 0 and res.cached.storage == res.cached_len
    assert res.cached.device == 0 and res.cached.host == 0
    second.drain()
    second.close()


def test_prefetched_state_attaches_to_an_existing_node_without_state():
    tree = RadixTree(PS, PageAllocator(16), SlotAllocator(4), PageAllocator(16), SlotAllocator(4), write_policy="write_back")
    toks = tuple(range(1, 17))
    ins = tree.insert(toks[:8], [0, 1])  # device-only, no state
    assert ins.node.device_state is None
    tree._device_kv.alloc(2)  # the pages handed over above
    hp = tree._host_kv.alloc(4)
    slot = tree._host_state.alloc(1)[0]
    r = tree.insert_host(toks, 0, hp, slot)
    assert r.attached and r.state_used and r.node.host_state == slot
    # The device-only node got the fetched page as its host copy.
    assert ins.node.host_pages == hp[:2]
    tree.check_invariants()
    hp2 = tree._host_kv.alloc(2)
    slot2 = tree._host_state.alloc(1)[0]
    r2 = tree.insert_host(toks[:8], 0, hp2, slot2)  # now duplicates: freed, state attaches to node 8
    assert r2.num_dup_freed == 2 and r2.state_used and ins.node.host_state == slot2
    tree.check_invariants()


def test_truncating_a_plan_cuts_tokens_keys_and_host_pages_together():
    toks = tuple(range(1, 25))
    keys = page_keys(None, toks, PS, FP)
    plan = PrefetchPlan(toks, keys, 2, [10, 11, 12, 13]).truncate(4, PS)
    assert plan.tokens == toks[:16] and plan.keys == keys[:4] and plan.host_pages == [10, 11]


def test_adaptive_prefetch_takes_the_aligned_free_host_size(tmp_path):
    first = Rig(tmp_path)
    toks = _prompt(41, 4)  # 10 pages; captures at 40
    # States at every other page boundary so a truncated hit still ends at a state.
    first.serve("a", toks[:17])
    first.serve("b", toks[:25])
    first.serve("c", toks)
    first.drain()
    first.close()
    small = Rig(tmp_path, host_pages=7, host_slots=4, hicache_storage_prefetch_policy="wait_complete")
    res = small.serve("d", toks + [3, 3, 3])
    assert small.tier.counters.truncations == 1
    assert 2 * PS <= res.cached.storage <= 7 * PS and res.cached.storage == res.cached_len
    small.drain()
    # A threshold above what fits gives up cleanly.
    tiny = Rig(tmp_path / "x", host_pages=3, host_slots=2, prefetch_threshold=20 * PS)
    res = tiny.serve("e", toks + [3])
    assert res.cached.storage == 0
    tiny.drain()
    small.close()
    tiny.close()


@pytest.mark.parametrize("policy", ["best_effort", "timeout", "wait_complete"])
def test_slow_storage_never_stalls_a_request(tmp_path, policy):
    first = Rig(tmp_path)
    toks = _prompt(33, 5)
    first.serve("a", toks)
    first.drain()
    first.close()
    slow = FlakyBackend(FileBackend(FP, tmp_path), 0.0, seed=1, slow_s=0.05)
    rig = Rig(
        tmp_path, backend=slow, hicache_storage_prefetch_policy=policy,
        prefetch_timeout_base_s=0.1, prefetch_timeout_per_ki_token_s=0.0, prefetch_timeout_max_s=1.0,
    )
    # A liveness bound, not a speed claim: every policy's prefetch ends (timeout cap 1 s) and the request is admitted.
    rig.serve("b", toks + [1, 2], max_wait_s=60.0)
    rig.drain()
    rig.close()


def test_cancel_and_failing_storage_leak_nothing(tmp_path):
    first = Rig(tmp_path)
    toks = _prompt(33, 6)
    first.serve("a", toks)
    first.drain()
    first.close()
    flaky = FlakyBackend(FileBackend(FP, tmp_path), 0.5, seed=3)
    rig = Rig(tmp_path, backend=flaky, hicache_storage_prefetch_policy="wait_complete")
    rig.ctrl.apply(Prefetch(rid="x", tokens=toks + [9]))
    rig.ctrl.apply(CancelPrefetch(rid="x"))
    for i in range(6):
        rig.serve(f"r{i}", toks + [i, i])
    rig.drain()
    host = rig.ctrl.tree
    assert rig.ctrl.host_kv.num_free + host.usage().host_pages_used == rig.ctrl.host_kv.capacity
    rig.close()


def test_a_store_back_from_an_outage_gets_the_whole_prefix_written_again(tmp_path):
    """A restarted store may be empty: after a reconnect, the next backup on a conversation
    writes its earlier pages again instead of trusting what the store acknowledged before."""
    store = tmp_path / "store"
    rig = Rig(store)
    toks = _prompt(26, 5)
    rig.serve("a", toks)
    rig.drain()
    keys = page_keys(None, toks[:24], PS, FP)
    assert rig.backend.exists(keys) == 6
    for f in [p for p in store.rglob("*") if p.is_file()]:
        f.unlink()  # the store restarted empty ...
    rig.backend.counters.add(num_reconnects=1)  # ... and the backend saw it come back
    longer = toks[:24] + _prompt(10, 6)
    rig.serve("b", longer)
    rig.drain()
    assert rig.backend.exists(page_keys(None, longer[:32], PS, FP)) == 8
    rig.close()


def test_known_keys_forget_the_oldest_beyond_their_bound():
    from himamba.services.cache.storage.known_keys import KnownKeys

    known = KnownKeys(max_keys=3)
    known.update([b"a", b"b", b"c"])
    known.add(b"a")  # refreshed: b is now the oldest
    known.add(b"d")
    assert b"b" not in known and all(k in known for k in (b"a", b"c", b"d")) and len(known) == 3
    known.clear()
    assert len(known) == 0 and b"a" not in known
    with pytest.raises(ValueError, match="max_keys"):
        KnownKeys(0)


def _stored_prefix(store, toks):
    """A store holding `toks` (10 pages) with states at pages 4, 6 and 10."""
    first = Rig(store)
    first.serve("a", toks[:17])
    first.serve("b", toks[:25])
    first.serve("c", toks)
    first.drain()
    first.close()


def _wait_lookup(rig, rid):
    deadline = time.monotonic() + 5
    while rig.tier.prefetches[rid].phase == "lookup":
        assert time.monotonic() < deadline, "the lookup never finished"
        time.sleep(0.005)
        rig.ctrl.poll_storage()


def _full_host(store, threshold_pages):
    """6 host pages, all holding other prefixes (evictable); the store as above."""
    rig = Rig(store, host_pages=6, host_slots=4, prefetch_threshold=threshold_pages * PS,
              hicache_storage_prefetch_policy="wait_complete")
    for i in range(3):
        rig.serve(f"o{i}", _prompt(9, 100 + i), prefetch=False)  # 2 pages each, backed up to host
    rig.drain()
    assert rig.ctrl.tree.usage().host_pages_used == 6 and rig.ctrl.host_kv.num_free == 0
    return rig


def test_the_fallback_leaves_the_host_tier_untouched_when_it_would_land_below_the_threshold(tmp_path):
    toks = _prompt(41, 4)
    _stored_prefix(tmp_path, toks)
    # 6 host pages at most; the deepest state within 6 pages is at 6 < the 7-page threshold.
    rig = _full_host(tmp_path, threshold_pages=7)
    rig.ctrl.apply(Prefetch(rid="d", tokens=toks + [3]))
    _wait_lookup(rig, "d")
    assert rig.tier.counters.outcomes["prefetch_no_host_memory"] == 1
    assert rig.ctrl.tree.usage().host_pages_used == 6, "the host tier was evicted for a prefetch then abandoned"
    rig.ctrl.apply(CancelPrefetch(rid="d"))
    rig.drain()
    rig.close()


def test_the_fallback_evicts_and_fetches_when_the_cut_hit_reaches_the_threshold(tmp_path):
    toks = _prompt(41, 4)
    _stored_prefix(tmp_path, toks)
    rig = _full_host(tmp_path, threshold_pages=5)
    res = rig.serve("d", toks + [3])
    assert rig.tier.counters.truncations == 1
    assert res.cached.storage == 6 * PS == res.cached_len  # cut back to the state at page 6
    rig.drain()
    rig.close()


def test_the_anchor_stays_pinned_through_the_lookup(tmp_path):
    toks = _prompt(41, 4)
    _stored_prefix(tmp_path, toks)
    rig = Rig(tmp_path / "other", host_pages=64, host_slots=8, hicache_storage_prefetch_policy="wait_complete")
    rig.backend = FileBackend(FP, tmp_path)
    rig.io = StorageIO(rig.backend, rig.host_kv, rig.host_state, page_size=PS, prefetch_budget_tokens=1024, batch_pages=2)
    rig.tier = rig.ctrl.attach_storage(rig.io, FP)
    rig.serve("a", toks[:17], prefetch=False)  # 4 pages on host: the anchor of the next prefetch
    rig.drain()
    rig.ctrl.apply(Prefetch(rid="p", tokens=toks + [5]))
    assert rig.tier.prefetches["p"].first_page == 4
    tree = rig.ctrl.tree
    tree.evict(10**6)
    tree.evict_host(10**6)  # host pressure while the lookup runs
    assert tree.usage().host_pages_used == 4, "the anchor was evicted during the lookup"
    res = rig.serve("p", toks + [5])
    assert "prefetch_anchor_gone" not in rig.tier.counters.outcomes
    assert res.cached_len == 40 and res.cached.storage == 24 and res.cached.host == 16
    rig.drain()
    rig.close()


class _Gate(FileBackend):
    """A file backend whose page reads stop after `allow` pages until `go` is set."""

    def __init__(self, store, allow: int):
        super().__init__(FP, store)
        import threading

        self.allow, self.served = allow, 0
        self.blocked, self.go = threading.Event(), threading.Event()

    def get_pages(self, keys, dest):
        if self.served >= self.allow:
            self.blocked.set()
            assert self.go.wait(10), "the test never opened the gate"
        n = super().get_pages(keys, dest)
        self.served += n
        return n


def test_best_effort_serves_a_hybrid_the_deepest_arrived_prefix_with_its_state(tmp_path):
    toks = _prompt(41, 4)
    _stored_prefix(tmp_path, toks)  # states at pages 4, 6 and 10
    gate = _Gate(tmp_path, allow=6)
    rig = Rig(tmp_path, backend=gate, hicache_storage_prefetch_policy="best_effort")
    rig.ctrl.apply(Prefetch(rid="x", tokens=toks + [7]))
    _wait_lookup(rig, "x")
    assert gate.blocked.wait(10)  # 6 pages and the states at 4 and 6 arrived; the rest is slow
    res = rig.ctrl.admit(Admit(rid="x", tokens=toks + [7], num_slots=1))
    assert res.prefetching  # revoked: it ends at the next batch boundary
    gate.go.set()
    res = rig.serve("x", toks + [7], prefetch=False)  # checks every served byte
    assert res.cached.storage == 24 == res.cached_len, "the arrived prefix and its state were discarded"
    rig.drain()
    rig.close()


def test_anchors_of_missed_lookups_are_released_before_a_hit_decides(tmp_path):
    toks = _prompt(41, 4)
    _stored_prefix(tmp_path, toks)
    rig = Rig(tmp_path, host_pages=12, host_slots=8, hicache_storage_prefetch_policy="wait_complete")
    others = [_prompt(17, 200 + i) for i in range(3)]
    for i, o in enumerate(others):
        rig.serve(f"o{i}", o, prefetch=False)  # 4 pages each: the host is full
    rig.drain()
    assert rig.ctrl.host_kv.num_free == 0
    # In one step: one prefetch for the stored 10-page prefix, which needs the whole host, then
    # three anchored on those prefixes (storage holds nothing more: misses).
    rig.ctrl.apply(Prefetch(rid="hit", tokens=toks + [3]))
    for i, o in enumerate(others):
        rig.ctrl.apply(Prefetch(rid=f"m{i}", tokens=o + _prompt(12, 300 + i)))
    deadline = time.monotonic() + 5
    while not all(pf.lookup.done() for pf in rig.tier.prefetches.values()):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    rig.ctrl.poll_storage()  # every lookup ends in this one poll
    assert rig.tier.prefetches["hit"].phase == "fetch", dict(rig.tier.counters.outcomes)
    for rid in ["m0", "m1", "m2", "hit"]:
        rig.ctrl.apply(CancelPrefetch(rid=rid))
    rig.drain()
    rig.close()


def test_a_prefix_whose_stored_values_were_all_corrupted_is_written_again_and_hits_resume(tmp_path):
    """Every stored value corrupted: each prefetch meets corruption and the request recomputes,
    and the backups of what it recomputed write the values again (this server believed them
    stored, which must not stop the rewrite), until the whole prefix is a storage hit again."""
    toks = _prompt(41, 4)
    _stored_prefix(tmp_path, toks)  # 10 pages, states at pages 4, 6 and 10
    num_bad = 0
    for seg in tmp_path.rglob("*.seg"):
        data = bytearray(seg.read_bytes())
        off = 0
        while off < len(data):
            nbytes = int.from_bytes(data[off + 12 : off + 20], "little")
            data[off + HEADER_BYTES + nbytes // 2] ^= 0x5A
            off += HEADER_BYTES + nbytes
            num_bad += 1
        seg.write_bytes(bytes(data))
    assert num_bad >= 13
    rig = Rig(tmp_path, hicache_storage_prefetch_policy="wait_complete")
    tree = rig.ctrl.tree
    hits = []
    for i in range(12):
        res = rig.serve(f"r{i}", toks + [3])  # every served byte checked
        hits.append(res.cached.storage)
        rig.drain()
        if res.cached.storage == 40:
            break
        tree.evict(10**6)
        tree.evict_host(10**6)  # the next request can only be served from storage
    assert hits[0] == 0 and hits[-1] == 40, hits
    assert rig.backend.stats().num_corrupt > 0
    rig.close()


def test_a_prefetch_that_cannot_have_a_host_state_slot_evicts_nothing(tmp_path):
    """Every host state slot pinned (another waiting request's prefetch holds it): the prefetch
    is refused before any host page is evicted for it."""
    toks = _prompt(41, 7)  # 10 pages in storage
    first = Rig(tmp_path)
    first.serve("a", toks, prefetch=False)
    first.drain()
    first.close()
    rig = Rig(tmp_path, host_pages=12, host_slots=1, hicache_storage_prefetch_policy="wait_complete")
    for i in range(3):
        rig.serve(f"o{i}", _prompt(9, 100 + i), prefetch=False)  # 6 host pages, evictable
    rig.drain()
    tree = rig.ctrl.tree
    stack, holder = [tree.root], None
    while stack:
        n = stack.pop()
        stack.extend(n.children.values())
        if n is not tree.root and n.host_state is not None:
            holder = n
    assert holder is not None
    pin = tree.protect_host(holder, kv=False, state=True)
    assert rig.ctrl.host_state.num_free == 0 and tree.usage().host_states_evictable == 0
    used = tree.usage().host_pages_used
    rig.ctrl.apply(Prefetch(rid="p", tokens=toks))
    _wait_lookup(rig, "p")
    assert rig.tier.counters.outcomes["prefetch_no_host_slot"] == 1
    assert tree.usage().host_pages_used == used, "host KV was evicted for a prefetch that was then refused"
    tree.release_host(pin)
    rig.ctrl.apply(CancelPrefetch(rid="p"))
    rig.drain()
    rig.close()


def test_best_effort_waits_for_a_hybrid_fetch_with_no_state_before_its_end(tmp_path):
    """A prefix stored by one request has its only state at its end: revoking the fetch at the
    first admission attempt would discard every page that arrived (the review saw 0 tokens
    served where wait_complete serves 40), so best_effort waits for the whole fetch instead."""
    toks = _prompt(41, 4)
    first = Rig(tmp_path)
    first.serve("a", toks)
    first.drain()
    first.close()
    gate = _Gate(tmp_path, allow=4)
    rig = Rig(tmp_path, backend=gate, hicache_storage_prefetch_policy="best_effort")
    rig.ctrl.apply(Prefetch(rid="x", tokens=toks + [7]))
    _wait_lookup(rig, "x")
    assert rig.tier.prefetches["x"].plan is not None and not rig.tier.prefetches["x"].mid
    assert gate.blocked.wait(10)  # 4 pages arrived; the rest is slow
    res = rig.ctrl.admit(Admit(rid="x", tokens=toks + [7], num_slots=1))
    assert res.prefetching and not rig.tier.prefetches["x"].revoked
    gate.go.set()
    res = rig.serve("x", toks + [7], prefetch=False)  # checks every served byte
    assert res.cached.storage == 40 == res.cached_len, "the fetched prefix was discarded"
    rig.drain()
    rig.close()


def test_best_effort_waits_for_a_stateless_hybrid_fetch_no_longer_than_the_timeout(tmp_path):
    toks = _prompt(41, 4)
    first = Rig(tmp_path)
    first.serve("a", toks)
    first.drain()
    first.close()
    gate = _Gate(tmp_path, allow=4)
    rig = Rig(
        tmp_path,
        backend=gate,
        hicache_storage_prefetch_policy="best_effort",
        prefetch_timeout_base_s=0.05,
        prefetch_timeout_per_ki_token_s=0.0,
    )
    rig.ctrl.apply(Prefetch(rid="x", tokens=toks + [7]))
    _wait_lookup(rig, "x")
    assert gate.blocked.wait(10)
    res = rig.serve("x", toks + [7], prefetch=False)  # the gate never opens: the deadline admits it
    assert res.cached_len == 0
    gate.go.set()
    rig.drain()
    rig.close()
