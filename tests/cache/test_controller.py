"""The cache controller driven like the scheduler drives it: admit, capture inserts, release,
multi-turn hits on device and host, and exact accounting throughout."""

from __future__ import annotations

import random

import pytest

from himamba.common.config import CacheConfig
from himamba.common.messages import Admit, Extend, Insert, Release
from himamba.services.cache.controller import CacheController

PS = 4


def _ctrl(pages=64, slots=16, host_pages=0, host_slots=0, **kw) -> CacheController:
    return CacheController(CacheConfig(page_size=PS, **kw), pages, slots, host_pages, host_slots)


def _serve(ctrl: CacheController, rid: str, tokens: list[int], gen: int = 3):
    """Admit, 'prefill' (insert every capture), decode `gen` tokens, release with insert."""
    res = ctrl.admit(Admit(rid=rid, tokens=tokens, num_slots=1))
    assert res.ok, res.reason
    ctrl.check_invariants()
    for pos, slot in res.captures:
        ins = ctrl.insert(Insert(rid=rid, tokens=tokens[:pos], slot=slot))
        assert ins.pages == res.pages[: len(ins.pages)] or len(ins.pages) == pos // PS
        ctrl.check_invariants()
    ctx = list(tokens)
    for i in range(gen):
        ctx.append(1000 + i)
        ext = ctrl.extend(Extend(rid=rid, total_len=len(ctx)))
        assert ext.ok
    done = len(ctx) - 1  # the last sampled token has no KV yet
    ctrl.release(Release(rid=rid, tokens=ctx[: done - done % PS], slot=None))
    ctrl.check_invariants()
    return res


def test_second_turn_hits_the_first_on_device():
    ctrl = _ctrl()
    turn1 = list(range(1, 23))  # 22 tokens: captures at the last whole page (20)
    r1 = _serve(ctrl, "a", turn1)
    assert r1.cached_len == 0 and [p for p, _ in r1.captures] == [20]
    turn2 = turn1 + [1000, 1001, 1002] + list(range(50, 60))
    r2 = _serve(ctrl, "b", turn2)
    assert r2.cached_len == 20 and r2.cached.device == 20 and r2.state_src is not None
    assert ctrl.stats().running_requests == 0


def test_branch_point_checkpoint_gives_the_next_request_a_full_hit():
    ctrl = _ctrl()
    shared = list(range(1, 17))  # 16 tokens = 4 pages
    _serve(ctrl, "a", shared + [90, 91, 92, 93, 94, 95, 96, 97, 98])  # state at 24 only
    b = _serve(ctrl, "b", shared + [70, 71, 72, 73, 74, 75])
    # b's KV match reaches 16 (the shared pages) but no state sits there: capture it (branch point)
    assert b.cached_len == 0 and b.branch_len == 16 and 16 in [p for p, _ in b.captures]
    c = _serve(ctrl, "c", shared + [50, 51, 52, 53, 54])
    assert c.cached_len == 16


@pytest.mark.parametrize("extra", [-1, 0, 1])
def test_exact_page_boundaries_leave_a_token_to_compute(extra):
    ctrl = _ctrl()
    base = list(range(1, 13))  # 3 pages
    _serve(ctrl, "a", base + [99])
    n = 12 + extra
    again = base[:n] if extra <= 0 else base + [99][:extra]
    res = ctrl.admit(Admit(rid="b", tokens=again, num_slots=1))
    assert res.ok and res.cached_len < len(again)
    ctrl.release(Release(rid="b"))
    ctrl.check_invariants()


def test_device_pressure_demotes_to_host_and_hits_come_back_from_host():
    ctrl = _ctrl(pages=12, slots=6, host_pages=64, host_slots=16)
    convs = {c: [random.Random(c).randrange(1, 500) for _ in range(18)] for c in "abcd"}
    for c, toks in convs.items():
        _serve(ctrl, c + "1", toks)
        for op_id in list(ctrl.pending):  # the worker acks every copy order
            ctrl.transfers_done([op_id])
    ctrl.take_transfers()
    res = ctrl.admit(Admit(rid="a2", tokens=convs["a"] + [7, 8, 9], num_slots=1))
    assert res.ok and res.cached_len == 16
    assert res.cached.host > 0
    kinds = [t.direction for t in ctrl.take_transfers()]
    assert "h2d" in kinds
    ctrl.check_invariants()
    ctrl.release(Release(rid="a2"))
    ctrl.check_invariants()


def test_exhaustion_is_an_answer_and_leaks_nothing():
    ctrl = _ctrl(pages=4, slots=2)
    big = ctrl.admit(Admit(rid="x", tokens=list(range(40)), num_slots=1))
    assert not big.ok and "KV pages" in big.reason
    ok = ctrl.admit(Admit(rid="y", tokens=list(range(8)), num_slots=1))
    assert ok.ok
    again = ctrl.admit(Admit(rid="z", tokens=list(range(100, 108)), num_slots=2))
    assert not again.ok
    ctrl.release(Release(rid="y"))
    ctrl.check_invariants()
    assert ctrl.stats().running_requests == 0


def test_a_refused_admission_counts_the_hits_lock_without_taking_it(monkeypatch):
    """The fit check counts what locking the hit would protect (nano-vllm's can_allocate before
    allocate): a refusal takes no lock, not even for a moment, and the count still sees that the
    hit's own pages cannot be evicted for the request that uses them."""
    ctrl = _ctrl(pages=8, slots=4)
    shared = list(range(1, 17))  # 4 pages, cached with a state at 16 by the first request
    _serve(ctrl, "a", shared + [99])
    tree = ctrl.tree
    assert ctrl.device_kv.num_free == 4 and tree.usage().device_pages_evictable == 4
    calls: list[str] = []
    monkeypatch.setattr(tree, "lock", lambda *a, **k: calls.append("lock"))
    monkeypatch.setattr(tree, "unlock", lambda *a, **k: calls.append("unlock"))
    before = tree.usage()
    # 36 tokens = 9 pages: the hit saves 4 but locks them, leaving 4 free for the other 5. Counting
    # the hit's pages as evictable would have admitted it; without the hit 9 > 8.
    res = ctrl.admit(Admit(rid="b", tokens=shared + list(range(100, 120)), num_slots=1))
    assert not res.ok and "KV pages" in res.reason
    assert calls == [], "the fit check took a lock"
    assert tree.usage() == before
    monkeypatch.undo()
    fits = ctrl.admit(Admit(rid="c", tokens=shared + list(range(100, 116)), num_slots=1))  # 8 pages
    assert fits.ok and fits.cached_len == 16
    ctrl.check_invariants()


def test_cache_disabled_only_allocates():
    ctrl = _ctrl(disable_radix_cache=True)
    r = ctrl.admit(Admit(rid="a", tokens=list(range(10)), num_slots=1))
    assert r.ok and r.cached_len == 0 and r.captures == []
    ctrl.release(Release(rid="a", tokens=list(range(8))))
    assert ctrl.stats().free_pages == 64 and ctrl.stats().free_slots == 16


def test_a_second_reservation_for_the_same_sibling_is_refused():
    """The controller does not trust `Admit.reserve`: overwriting a reservation would leave its
    slots owned by nobody, and a running sample cannot be reserved for."""
    c = _ctrl(hicache_storage_backend="none")
    a = c.apply(Admit(rid="s0", tokens=list(range(1, 10)), num_slots=2, reserve=["s1"]))
    assert a.ok
    free = c.device_state.num_free
    b = c.apply(Admit(rid="x0", tokens=list(range(20, 29)), num_slots=2, reserve=["s1"]))
    assert not b.ok and "s1" in b.reason
    assert c.device_state.num_free == free and "x0" not in c.requests
    c.check_invariants()
    d = c.apply(Admit(rid="y0", tokens=list(range(40, 49)), num_slots=2, reserve=["s0"]))
    assert not d.ok and "s0" in d.reason
    c.check_invariants()
    s1 = c.apply(Admit(rid="s1", tokens=list(range(1, 10)), num_slots=2))
    assert s1.ok  # the sibling's own reservation is intact
    c.check_invariants()
