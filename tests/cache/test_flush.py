"""Flushing the cache (sglang's /flush_cache): refused while a request holds cache memory or a
copy is in flight; an idle controller becomes an empty one of the same sizes, so the next turn
of a conversation misses on device and host alike."""

from __future__ import annotations

from himamba.common.config import CacheConfig
from himamba.common.messages import Admit, Insert, Release
from himamba.services.cache.controller import CacheController
from himamba.services.cache.flush import flush_refusal, flushed

PS = 4


def _serve(ctrl: CacheController, rid: str, tokens: list[int]) -> int:
    """Admit, insert every capture, release with the whole pages: the cached length it got."""
    res = ctrl.admit(Admit(rid=rid, tokens=tokens, num_slots=1))
    assert res.ok, res.reason
    for pos, slot in res.captures:
        ctrl.insert(Insert(rid=rid, tokens=tokens[:pos], slot=slot))
    ctrl.release(Release(rid=rid, tokens=tokens[: len(tokens) - len(tokens) % PS], slot=None))
    ctrl.check_invariants()
    return res.cached_len


def test_flush_empties_device_and_host_and_is_refused_while_in_use():
    ctrl = CacheController(CacheConfig(page_size=PS), 64, 16, 128, 32)
    history = list(range(1, 30))
    assert _serve(ctrl, "a", history) == 0
    assert ctrl.take_transfers()  # write_through: the host copies are ordered ...
    # ... and not acknowledged yet: a flush now is refused, as transient.
    refusal = flush_refusal(ctrl)
    assert refusal is not None and refusal.busy
    ctrl.transfers_done(list(ctrl.pending))
    assert flush_refusal(ctrl) is None
    st = ctrl.stats()
    assert st.cached_pages > 0 and st.free_host_pages < st.total_host_pages

    # A running request holds memory: refused (not transient), and nothing changes.
    running = ctrl.admit(Admit(rid="r", tokens=history + [7, 7, 7], num_slots=1))
    assert running.ok and running.cached.device > 0
    refusal = flush_refusal(ctrl)
    assert refusal is not None and not refusal.busy and "1 request" in refusal.reason
    ctrl.release(Release(rid="r"))

    new, freed = flushed(ctrl)
    assert freed.device_pages > 0 and freed.host_pages > 0 and freed.device_states > 0
    new.check_invariants()
    s = new.stats()
    assert (s.free_pages, s.free_slots) == (s.total_pages, s.total_slots) == (64, 16)
    assert (s.free_host_pages, s.free_host_slots) == (s.total_host_pages, s.total_host_slots) == (128, 32)
    assert s.cached_pages == 0 and s.cached_slots == 0
    res = new.admit(Admit(rid="b", tokens=history + [5], num_slots=1))
    assert res.ok and res.cached.total == 0  # nothing left on device or host
    new.release(Release(rid="b"))
    new.check_invariants()


def test_flush_without_radix_cache_is_a_no_op():
    ctrl = CacheController(CacheConfig(page_size=PS, disable_radix_cache=True), 8, 4)
    new, freed = flushed(ctrl)
    assert freed == (0, 0, 0, 0) and new.stats().free_pages == 8
