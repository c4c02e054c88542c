"""Copy orders that fail: the controller rolls the tree back so no hit ever reads memory that was
never written, releases every host pin, and an order ends exactly once. A fake worker moves real
bytes (a failed order scribbles over its destinations, as a copy that died half-way would), and a
byte oracle checks every page and state the tree points at."""

from __future__ import annotations

import hashlib

import torch

from himamba.common.config import CacheConfig
from himamba.common.messages import Admit, Release, Transfer
from himamba.services.cache.controller import CacheController

PS = 4
PAGE_BYTES = 16
SLOT_BYTES = 8


def content(tokens: tuple[int, ...] | list[int], nbytes: int) -> torch.Tensor:
    """What a page (or a state) computed over exactly `tokens` holds."""
    d = hashlib.sha256(repr(tuple(tokens)).encode()).digest()
    return torch.tensor(list(d[:nbytes]), dtype=torch.uint8)


class FakeWorker:
    """Byte pools and a copy executor that fails the orders it is told to."""

    def __init__(self, ctrl: CacheController, pages: int, slots: int, host_pages: int, host_slots: int):
        self.ctrl = ctrl
        self.dev_kv = torch.zeros(pages, PAGE_BYTES, dtype=torch.uint8)
        self.dev_state = torch.zeros(slots, SLOT_BYTES, dtype=torch.uint8)
        self.host_kv = torch.zeros(host_pages, PAGE_BYTES, dtype=torch.uint8)
        self.host_state = torch.zeros(host_slots, SLOT_BYTES, dtype=torch.uint8)
        self.issued: list[int] = []
        self.ended: list[int] = []

    def copy(self, t: Transfer, ok: bool) -> None:
        d2h = t.direction == "d2h"
        src_kv, dst_kv = (self.dev_kv, self.host_kv) if d2h else (self.host_kv, self.dev_kv)
        src_st, dst_st = (self.dev_state, self.host_state) if d2h else (self.host_state, self.dev_state)
        for s, d in zip(t.kv_src, t.kv_dst):
            dst_kv[d] = src_kv[s] if ok else 0xEE
        for s, d in zip(t.state_src, t.state_dst):
            dst_st[d] = src_st[s] if ok else 0xEE

    def run(self, fail=lambda t: False) -> list[Transfer]:
        """Execute every order issued so far; returns the ones that failed."""
        ts = self.ctrl.take_transfers()
        self.issued += [t.op_id for t in ts]
        bad = [t for t in ts if fail(t)]
        for t in ts:
            self.copy(t, t not in bad)
        self.ended += [t.op_id for t in ts]
        self.ctrl.transfers_done([t.op_id for t in ts if t not in bad], [t.op_id for t in bad])
        return bad

    def prefill(self, res, tokens: list[int]) -> None:
        """Write what the forward would: the request's own pages and its capture slots."""
        for i in range(res.cached_len // PS, len(tokens) // PS):
            self.dev_kv[res.pages[i]] = content(tokens[: (i + 1) * PS], PAGE_BYTES)


def make(write_policy: str = "write_through", pages: int = 32, host_pages: int = 32):
    ctrl = CacheController(
        CacheConfig(page_size=PS, hicache_storage_backend="none", hicache_write_policy=write_policy),  # type: ignore[arg-type]
        pages, 16, host_pages, 16,
    )
    return ctrl, FakeWorker(ctrl, pages, 16, host_pages, 16)


def check_oracle(ctrl: CacheController, w: FakeWorker) -> None:
    """Every page and state the tree points at holds what computing it produced."""
    assert not ctrl.pending, "oracle runs with no copy in flight"
    tree = ctrl.tree
    stack = [(tree.root, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            toks = path + child.key
            base = len(path) // PS
            for i in range(len(child.key) // PS):
                want = content(toks[: (base + i + 1) * PS], PAGE_BYTES)
                if child.device_pages is not None:
                    assert torch.equal(w.dev_kv[child.device_pages[i]], want), f"node {child.id} device page {i}"
                if child.host_pages is not None:
                    assert torch.equal(w.host_kv[child.host_pages[i]], want), f"node {child.id} host page {i}"
            if child.device_state is not None:
                assert torch.equal(w.dev_state[child.device_state], content(toks, SLOT_BYTES)), f"node {child.id} state"
            if child.host_state is not None:
                assert torch.equal(w.host_state[child.host_state], content(toks, SLOT_BYTES)), f"node {child.id} hstate"
            stack.append((child, toks))


def serve(ctrl: CacheController, w: FakeWorker, rid: str, tokens: list[int], fail=lambda t: False, ok: bool = True):
    """Admit, run the copies (failing some), 'prefill' and release as the scheduler would: a batch
    whose copies failed fails its request, which releases without inserting."""
    res = ctrl.admit(Admit(rid=rid, tokens=tokens, num_slots=1))
    assert res.ok, res.reason
    bad = w.run(fail)
    if bad or not ok:
        ctrl.release(Release(rid=rid))
        w.run()
        return res, False
    for i in range(res.cached_len // PS):
        assert torch.equal(w.dev_kv[res.pages[i]], content(tokens[: (i + 1) * PS], PAGE_BYTES)), f"hit page {i} lies"
    if res.cached_len:
        assert torch.equal(w.dev_state[res.state_src], content(tokens[: res.cached_len], SLOT_BYTES)), "hit state lies"
    w.prefill(res, tokens)
    n = len(tokens) // PS * PS
    slot = res.slots[0]
    w.dev_state[slot] = content(tokens[:n], SLOT_BYTES)
    ctrl.release(Release(rid=rid, tokens=tokens[:n], slot=slot))
    w.run()
    return res, True


def settled(ctrl: CacheController, w: FakeWorker) -> None:
    w.run()
    ctrl.take_transfers()
    ctrl.check_invariants()
    check_oracle(ctrl, w)
    u = ctrl.tree.usage()
    assert u.host_pages_protected == 0 and u.host_states_protected == 0, "a host pin leaked"
    assert u.pending_backups == 0 and u.pending_loads == 0
    assert u.taints == 0
    assert sorted(w.issued) == sorted(w.ended) == sorted(set(w.ended)), "an order did not end exactly once"


PROMPT = list(range(100, 125))  # 6 whole pages + 1 token


def test_failed_load_back_is_rolled_back_after_the_request_lets_go():
    ctrl, w = make()
    serve(ctrl, w, "a", PROMPT)
    ctrl.tree.evict(100)  # write_through: demoted to host
    assert ctrl.tree.usage().device_pages_used == 0 and ctrl.tree.usage().host_pages_used == 6
    res, ok = serve(ctrl, w, "b", PROMPT, fail=lambda t: t.direction == "h2d")
    assert not ok and res.cached.host == 24
    # The failed request let go and the loaded copies are gone; the host copy is intact.
    assert ctrl.failed_transfers == 1
    assert ctrl.tree.usage().device_pages_used == 0 and ctrl.tree.usage().host_pages_used == 6
    settled(ctrl, w)
    res, ok = serve(ctrl, w, "c", PROMPT)
    assert ok and res.cached_len == 24 and res.cached.host == 24
    settled(ctrl, w)


def test_a_tainted_node_is_not_matched_while_its_rollback_waits_for_a_lock():
    ctrl, w = make()
    serve(ctrl, w, "a", PROMPT)
    ctrl.tree.evict(100)
    res = ctrl.admit(Admit(rid="b", tokens=PROMPT, num_slots=1))
    assert res.ok and res.cached.host == 24
    w.run(fail=lambda t: t.direction == "h2d")
    assert ctrl.tree.usage().taints == 1  # b still holds the lock on the unwritten copy
    other = ctrl.admit(Admit(rid="c", tokens=PROMPT, num_slots=1))
    assert other.ok and other.cached_len == 0, "a hit on memory that was never written"
    ctrl.release(Release(rid="c"))
    ctrl.release(Release(rid="b"))
    settled(ctrl, w)
    res, ok = serve(ctrl, w, "d", PROMPT)
    assert ok and res.cached_len == 24
    settled(ctrl, w)


def test_failed_backup_drops_the_host_copy_and_its_pins():
    ctrl, w = make()
    _, ok = serve(ctrl, w, "a", PROMPT[:9])  # two pages, backed up under write_through
    assert ok
    res = ctrl.admit(Admit(rid="b", tokens=PROMPT, num_slots=1))
    assert res.ok and res.cached_len == 8
    w.run()
    w.prefill(res, PROMPT)
    w.dev_state[res.slots[0]] = content(PROMPT[:24], SLOT_BYTES)
    ctrl.release(Release(rid="b", tokens=PROMPT[:24], slot=res.slots[0]))
    bad = w.run(fail=lambda t: t.direction == "d2h")
    assert len(bad) == 1
    assert ctrl.tree.usage().host_pages_used == 2, "the unwritten host copy must be forgotten"
    settled(ctrl, w)
    ctrl.tree.evict(100)  # the node without a host copy is deleted, not demoted onto garbage
    settled(ctrl, w)
    res, ok = serve(ctrl, w, "c", PROMPT)
    assert ok and res.cached_len == 8
    settled(ctrl, w)


def test_failed_write_back_backup_loses_the_node_not_the_truth():
    ctrl, w = make("write_back", pages=12)
    serve(ctrl, w, "a", PROMPT)
    # Eviction under write_back orders a backup and frees the device copy at once.
    serve(ctrl, w, "b", list(range(300, 325)), fail=lambda t: t.direction == "d2h", ok=False)
    assert ctrl.failed_transfers >= 1
    settled(ctrl, w)
    res, ok = serve(ctrl, w, "c", PROMPT)
    assert ok
    settled(ctrl, w)


def test_a_failure_after_a_split_rolls_back_both_halves():
    ctrl, w = make()
    serve(ctrl, w, "a", PROMPT)
    ctrl.tree.evict(100)
    res = ctrl.admit(Admit(rid="b", tokens=PROMPT, num_slots=1))
    w.run(fail=lambda t: t.direction == "h2d")
    assert ctrl.tree.usage().taints == 1
    # A request sharing 2 pages splits the tainted node while its rollback waits.
    res2 = ctrl.admit(Admit(rid="c", tokens=PROMPT[:8] + [1, 2, 3, 4, 5], num_slots=1))
    assert res2.ok and res2.cached_len == 0
    ctrl.release(Release(rid="c"))
    ctrl.release(Release(rid="b"))
    settled(ctrl, w)
    assert res.ok
