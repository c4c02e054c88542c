"""Hypothesis state machine over the cache controller and a simulated worker whose copies fail or
complete late, and a storage tier whose I/O completes late, out of order, or fails.

The tree machine (test_tree_machine.py) applies every copy the moment it is issued. Here the
controller is driven as the scheduler drives it (Admit, Release with insert, CancelPrefetch,
Prefetch) and its copy orders go into a worker queue that runs strictly in order, as the worker
does, but only when a rule says so: a request's forward is queued behind the copies its admission
produced. Any copy may fail: its destinations then hold garbage, as a copy that died half-way
would, and the worker's guard fails a forward that reads them. The worker's reports (done and
failed orders) reach the controller later still, in order. Storage lookups and jobs are futures
the machine completes whenever it likes, in any order, fully, partly or failing.

The oracle: every page and state holds the prefix it was computed for. A forward that does not
fail must read exactly its prefix (no hit ever reads memory that was not written); every node the
tree points at holds its prefix, except destinations of copies still queued and subtrees awaiting
a rollback; after the worker drains and its reports arrive, every host pin is released and every
pool is back to free + cached.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from himamba.common.config import CacheConfig
from himamba.common.messages import Admit, CancelPrefetch, Prefetch, Release, Transfer
from himamba.services.cache.controller import CacheController
from himamba.services.cache.storage.base import StorageHit, StorageStats
from himamba.services.cache.storage.io_workers import JobOutcome, JobResult, StateCopy
from himamba.services.cache.tree.node import TreeNode

EXAMPLES = int(os.environ.get("HIMAMBA_HYPOTHESIS_EXAMPLES", "60"))
PS = 2
GARBAGE = ("garbage",)
Prefix = tuple[Any, ...]


def path_tokens(node: TreeNode) -> Prefix:
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return tuple(t for part in reversed(parts) for t in part)


# ---------------------------------------------------------------- a storage I/O the machine drives


class FakeBackend:
    """Only what the storage tier asks the backend directly."""

    def stats(self) -> StorageStats:
        return StorageStats()


@dataclass(eq=False)
class FakeJob:
    kind: str
    keys: list[bytes]
    host_pages: list[int]
    state: StateCopy | None
    mid: list[tuple[int, StateCopy]]
    future: Future = field(default_factory=Future)
    revoked: bool = False

    def revoke(self) -> int:
        self.revoked = True
        return 0

    @property
    def num_pages(self) -> int:
        return 0


class FakeIO:
    """StorageIO's interface; lookups and jobs stay pending until the machine completes them."""

    def __init__(self) -> None:
        self.backend = FakeBackend()
        self.lookups: list[tuple[list[bytes], Future]] = []
        self.jobs: list[FakeJob] = []

    def lookup(self, keys: list[bytes], *, needs_state: bool) -> Future:
        f: Future = Future()
        self.lookups.append((list(keys), f))
        return f

    def submit_backup(self, keys, host_pages, state=None, tag=None) -> FakeJob:
        job = FakeJob("backup", list(keys), list(host_pages), state, [])
        self.jobs.append(job)
        return job

    def submit_prefetch(self, keys, host_pages, state=None, tag=None, mid_states=()) -> FakeJob:
        job = FakeJob("prefetch", list(keys), list(host_pages), state, list(mid_states))
        self.jobs.append(job)
        return job

    def close(self, drain: bool = False, timeout_s: float = 0.0) -> None:
        pass


# ---------------------------------------------------------------- the machine


@dataclass
class Req:
    rid: str
    tokens: Prefix
    res: Any = None
    state: str = "waiting"  # waiting -> queued -> ran | failed
    waits: int = 0


class ControllerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.reqs: dict[str, Req] = {}
        self.next_rid = 0
        self.queue: list[tuple[str, Any]] = []  # the worker's inbox, run in order
        self.reports: list[tuple[list[int], list[int]]] = []  # TransfersDone on their way
        self.in_flight: set[int] = set()  # issued order ids not yet ended at the worker
        self.ended: list[int] = []
        self.issued: list[int] = []
        self.dev: dict[int, Prefix] = {}
        self.host: dict[int, Prefix] = {}
        self.dev_st: dict[int, Prefix] = {}
        self.host_st: dict[int, Prefix] = {}
        self.store_kv: dict[bytes, Prefix] = {}
        self.store_st: dict[bytes, Prefix] = {}
        self.key_prefix: dict[bytes, Prefix] = {}
        # Failed copies the controller has not heard of yet: until it does, the tree may point at
        # their destinations (the worker's guard keeps everything from reading them meanwhile).
        self.failed_unheard: dict[int, Transfer] = {}

    @initialize(
        pages=st.integers(10, 24),
        slots=st.integers(4, 8),
        host_factor=st.sampled_from([0.5, 1, 2]),
        write_policy=st.sampled_from(["write_through", "write_back"]),
        policy=st.sampled_from(["best_effort", "wait_complete"]),
        storage=st.booleans(),
    )
    def setup(self, pages, slots, host_factor, write_policy, policy, storage):
        cfg = CacheConfig(
            page_size=PS, hicache_storage_backend="file" if storage else "none", hicache_write_policy=write_policy,
            hicache_storage_prefetch_policy=policy, prefetch_threshold=PS, prefetch_timeout_max_s=1e9,
        )  # fmt: skip
        self.ctrl = CacheController(cfg, pages, slots, int(pages * host_factor), int(slots * host_factor))
        self.io = FakeIO() if storage else None
        if self.io is not None:
            tier = self.ctrl.attach_storage(self.io, b"\x01" * 32)
            assert tier is not None

    # ------------------------------------------------------------ helpers

    def queue_transfers(self) -> None:
        for t in self.ctrl.take_transfers():
            self.queue.append(("copy", t))
            self.issued.append(t.op_id)
            self.in_flight.add(t.op_id)

    def pending_dst(self) -> tuple[set[int], set[int], set[int], set[int]]:
        """Destinations of copies still queued, or failed unheard (device pages and slots, host pages
        and slots)."""
        dp, ds, hp, hs = set(), set(), set(), set()
        for kind, t in [*self.queue, *(("copy", t) for t in self.failed_unheard.values())]:
            if kind != "copy":
                continue
            if t.direction == "d2h":
                hp.update(t.kv_dst)
                hs.update(t.state_dst)
            else:
                dp.update(t.kv_dst)
                ds.update(t.state_dst)
        return dp, ds, hp, hs

    def draw_tokens(self, data) -> Prefix:
        base: Prefix = ()
        stored = [p for k, p in self.key_prefix.items() if k in self.store_kv]
        if stored and data.draw(st.booleans()):
            base = data.draw(st.sampled_from(sorted(stored)))  # a prefix storage holds
        elif self.reqs or data.draw(st.booleans()):
            pool = [r.tokens for r in self.reqs.values()] + [p for p in self.key_prefix.values()]
            if pool:
                base = data.draw(st.sampled_from(sorted(pool)))
                base = base[: data.draw(st.integers(0, len(base) // PS)) * PS]
        n = data.draw(st.integers(1, 5)) * PS + data.draw(st.integers(1, PS))
        rest = tuple(data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)))
        return (base + rest)[: max(len(base) + 1, n)]

    # ------------------------------------------------------------ the scheduler's side

    @rule(data=st.data(), prefetch=st.booleans())
    def add_request(self, data, prefetch):
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        req = self.reqs[rid] = Req(rid, self.draw_tokens(data))
        if prefetch and self.io is not None:
            self.ctrl.apply(Prefetch(rid=rid, tokens=list(req.tokens)))
        self.try_admit(req)

    @precondition(lambda self: self.io is not None)
    @rule(data=st.data())
    def serve_and_store(self, data):
        """A shortcut to a stored conversation: serve a request through (no copy fails), then let
        every report arrive and every storage write complete."""
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        req = self.reqs[rid] = Req(rid, self.draw_tokens(data))
        self.try_admit(req)
        for _ in range(2):
            while self.queue:
                kind, item = self.queue.pop(0)
                if kind == "copy":
                    ok = not self.reads_garbage(item)
                    self.copy(item, ok)
                    self.reports.append(([item.op_id], []) if ok else ([], [item.op_id]))
                    if not ok:
                        self.failed_unheard[item.op_id] = item
                    self.in_flight.discard(item.op_id)
                    self.ended.append(item.op_id)
                else:
                    self.forward(self.reqs.get(item))
            if rid in self.reqs and self.reqs[rid].state in ("ran", "failed"):
                r = self.reqs.pop(rid)
                n = len(r.tokens) // PS * PS
                ok = r.state == "ran"
                self.ctrl.apply(Release(rid=rid, tokens=list(r.tokens[:n]) if ok else [], slot=r.res.slots[0] if ok else None))
                self.queue_transfers()
        self.reports_arrive(10**6)
        assert self.io is not None
        while any(j.kind == "backup" for j in self.io.jobs):
            job = next(j for j in self.io.jobs if j.kind == "backup")
            self.io.jobs.remove(job)
            self.complete_job(job, "done", data)
            self.ctrl.poll_storage()
        self.the_tree_points_only_at_written_memory()  # learns the page keys of what was stored

    @precondition(lambda self: self.io is not None and self.store_kv)
    @rule(data=st.data(), forget=st.booleans())
    def request_a_stored_prefix(self, data, forget):
        """A request for what storage holds, usually after the tree forgot it: its prefetch then
        runs while other rules go on (lookup and job complete whenever the machine says)."""
        if forget:
            self.forget_everything_evictable()
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        stored = sorted(p for k, p in self.key_prefix.items() if k in self.store_kv)
        base = data.draw(st.sampled_from(stored)) if stored else ()
        req = self.reqs[rid] = Req(rid, base + tuple(data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=2 * PS))))
        self.ctrl.apply(Prefetch(rid=rid, tokens=list(req.tokens)))
        self.try_admit(req)

    def try_admit(self, req: Req) -> None:
        res = self.ctrl.apply(Admit(rid=req.rid, tokens=list(req.tokens), num_slots=1))
        self.queue_transfers()
        if res.ok:
            req.res = res
            req.state = "queued"
            self.queue.append(("forward", req.rid))
        elif not res.prefetching:
            self.ctrl.apply(CancelPrefetch(rid=req.rid))
            del self.reqs[req.rid]

    @precondition(lambda self: any(r.state == "waiting" for r in self.reqs.values()))
    @rule(data=st.data(), cancel=st.booleans())
    def retry_waiting(self, data, cancel):
        rid = data.draw(st.sampled_from(sorted(r.rid for r in self.reqs.values() if r.state == "waiting")))
        if cancel:
            self.ctrl.apply(CancelPrefetch(rid=rid))
            del self.reqs[rid]
        else:
            self.try_admit(self.reqs[rid])

    @precondition(lambda self: any(r.state in ("ran", "failed") for r in self.reqs.values()))
    @rule(data=st.data(), insert=st.booleans())
    def release(self, data, insert):
        rid = data.draw(st.sampled_from(sorted(r.rid for r in self.reqs.values() if r.state in ("ran", "failed"))))
        req = self.reqs.pop(rid)
        if req.state == "ran" and insert:
            n = len(req.tokens) // PS * PS
            self.ctrl.apply(Release(rid=rid, tokens=list(req.tokens[:n]), slot=req.res.slots[0]))
        else:
            self.ctrl.apply(Release(rid=rid))  # a failed batch fails its request: nothing inserted
        self.queue_transfers()

    @rule()
    def forget_everything_evictable(self):
        """Device and host eviction of all they can free: what is stored comes back from storage."""
        tree = self.ctrl.tree
        self.ctrl._order_backups(tree.evict(10**6).backups)
        tree.evict_host(10**6)
        self.queue_transfers()

    @rule(kind=st.sampled_from(["kv", "host"]), n=st.integers(1, 6) | st.just(10**6))
    def evict(self, kind, n):
        tree = self.ctrl.tree
        r = tree.evict(n) if kind == "kv" else tree.evict_host(n)
        self.ctrl._order_backups(r.backups)
        self.queue_transfers()

    # ------------------------------------------------------------ the worker

    @precondition(lambda self: self.queue)
    @rule(data=st.data(), n=st.integers(1, 4))
    def worker_runs(self, data, n):
        """The worker takes the next `n` items of its inbox, in order; any copy may fail."""
        done: list[int] = []
        failed: list[int] = []
        for _ in range(min(n, len(self.queue))):
            kind, item = self.queue.pop(0)
            if kind == "copy":
                # After a failure the rest of the batch fails unrun; a copy of unwritten memory fails.
                ok = not failed and not self.reads_garbage(item) and data.draw(st.integers(0, 5)) > 0
                self.copy(item, ok)
                (done if ok else failed).append(item.op_id)
                if not ok:
                    self.failed_unheard[item.op_id] = item
                self.in_flight.discard(item.op_id)
                self.ended.append(item.op_id)
            else:
                self.forward(self.reqs.get(item))
        if done or failed:
            self.reports.append((done, failed))

    def reads_garbage(self, t: Transfer) -> bool:
        src, src_st = (self.dev, self.dev_st) if t.direction == "d2h" else (self.host, self.host_st)
        return any(src.get(p) == GARBAGE for p in t.kv_src) or any(src_st.get(s) == GARBAGE for s in t.state_src)

    def copy(self, t: Transfer, ok: bool) -> None:
        d2h = t.direction == "d2h"
        src, dst = (self.dev, self.host) if d2h else (self.host, self.dev)
        src_st, dst_st = (self.dev_st, self.host_st) if d2h else (self.host_st, self.dev_st)
        for s, d in zip(t.kv_src, t.kv_dst):
            dst[d] = src[s] if ok else GARBAGE
        for s, d in zip(t.state_src, t.state_dst):
            dst_st[d] = src_st[s] if ok else GARBAGE

    def forward(self, req: Req | None) -> None:
        if req is None or req.state != "queued":
            return
        res = req.res
        k = res.cached_len // PS
        reads = [self.dev.get(p) for p in res.pages[:k]]
        state = self.dev_st.get(res.state_src) if res.cached_len else None
        if GARBAGE in reads or state == GARBAGE:
            req.state = "failed"  # the worker's guard: an error, never a wrong answer
            return
        for i, got in enumerate(reads):
            assert got == req.tokens[: (i + 1) * PS], f"{req.rid} read page {i} that holds {got}"
        if res.cached_len:
            assert state == req.tokens[: res.cached_len], f"{req.rid} read a state that holds {state}"
        for i in range(k, len(req.tokens) // PS):
            self.dev[res.pages[i]] = req.tokens[: (i + 1) * PS]
        self.dev_st[res.slots[0]] = req.tokens[: len(req.tokens) // PS * PS]
        for pos, slot in res.captures:
            self.dev_st[slot] = req.tokens[:pos]
        req.state = "ran"

    @precondition(lambda self: self.reports)
    @rule(n=st.integers(1, 3))
    def reports_arrive(self, n: int) -> None:
        """TransfersDone messages reach the controller, late but in order."""
        for _ in range(min(n, len(self.reports))):
            done, failed = self.reports.pop(0)
            self.ctrl.transfers_done(done, failed)
            for op_id in failed:
                del self.failed_unheard[op_id]
            self.queue_transfers()  # storage backups start on done ones; rollbacks retry

    # ------------------------------------------------------------ storage, late and out of order

    @precondition(lambda self: self.io is not None and (self.io.lookups or self.io.jobs))
    @rule(data=st.data(), outcome=st.sampled_from(["done", "partial", "fail"]))
    def storage_completes(self, data, outcome):
        io = self.io
        n_lookups = len(io.lookups)
        i = data.draw(st.integers(0, n_lookups + len(io.jobs) - 1))
        if i < n_lookups:
            keys, f = io.lookups.pop(i)
            self.complete_lookup(keys, f, outcome)
        else:
            self.complete_job(io.jobs.pop(i - n_lookups), outcome, data)
        self.ctrl.poll_storage()
        self.queue_transfers()

    def complete_lookup(self, keys: list[bytes], f: Future, outcome: str) -> None:
        if outcome == "fail":
            f.set_result(StorageHit(0, 0))
            return
        n = 0
        while n < len(keys) and keys[n] in self.store_kv:
            n += 1
        ends = tuple(i + 1 for i in range(n) if keys[i] in self.store_st)
        f.set_result(StorageHit(n, ends[-1] if ends else 0, ends))

    def complete_job(self, job: FakeJob, outcome: str, data) -> None:
        n = len(job.keys)
        if job.kind == "backup":
            got = n if outcome == "done" else (data.draw(st.integers(0, n)) if outcome == "partial" else 0)
            for k, h in zip(job.keys[:got], job.host_pages[:got]):
                assert self.host.get(h) not in (None, GARBAGE), "storage read host memory that was never written"
                self.store_kv[k] = self.host[h]
            state_ok = outcome == "done" and job.state is not None
            if state_ok:
                self.store_st[job.state.page_key] = self.host_st[job.state.host_slot]  # type: ignore[union-attr]
        else:
            got = 0 if outcome == "fail" else n if outcome == "done" and not job.revoked else data.draw(st.integers(0, n))
            got = min(got, sum(1 for k in job.keys if k in self.store_kv))
            while got and any(k not in self.store_kv for k in job.keys[:got]):
                got -= 1
            for k, h in zip(job.keys[:got], job.host_pages[:got]):
                self.host[h] = self.store_kv[k]
            state_ok = got == n and job.state is not None and job.state.page_key in self.store_st
            if state_ok:
                self.host_st[job.state.host_slot] = self.store_st[job.state.page_key]  # type: ignore[union-attr]
            read = []
            for at, sc in job.mid:
                if at <= got and sc.page_key in self.store_st:
                    self.host_st[sc.host_slot] = self.store_st[sc.page_key]
                    read.append(at)
        res = JobResult(
            0, job.kind, None, JobOutcome.DONE if got == n and (job.state is None or state_ok) else JobOutcome.PARTIAL,
            got, state_ok, 0, 0, 0.0, 0.0, None, tuple(read) if job.kind == "prefetch" else (),
        )  # fmt: skip
        job.future.set_result(res)

    # ------------------------------------------------------------ invariants

    @invariant()
    def controller_invariants(self):
        self.ctrl.check_invariants()

    @invariant()
    def the_tree_points_only_at_written_memory(self):
        tree = self.ctrl.tree
        dp, ds, hp, hs = self.pending_dst()
        stack = [tree.root]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                if tree.tainted(child):
                    continue  # a failed copy's rollback waits for a lock: nobody can match it
                stack.append(child)
                full = path_tokens(child)
                start = len(full) - len(child.key)
                for i, p in enumerate(child.device_pages or ()):
                    if p not in dp:
                        assert self.dev.get(p) == full[: start + (i + 1) * PS], f"device page {p} of node {child.id}"
                for i, p in enumerate(child.host_pages or ()):
                    if p not in hp:
                        assert self.host.get(p) == full[: start + (i + 1) * PS], f"host page {p} of node {child.id}"
                if child.device_state is not None and child.device_state not in ds:
                    assert self.dev_st.get(child.device_state) == full, f"device state of node {child.id}"
                if child.host_state is not None and child.host_state not in hs:
                    assert self.host_st.get(child.host_state) == full, f"host state of node {child.id}"
                if child.page_hashes:
                    for i, k in enumerate(child.page_hashes):
                        self.key_prefix[k] = full[: start + (i + 1) * PS]

    def teardown(self):
        if not hasattr(self, "ctrl"):
            return
        ctrl = self.ctrl
        # Let everything end: storage completes, the worker drains, reports arrive, requests go.
        for _ in range(50):
            if self.io is not None:
                while self.io.lookups:
                    self.complete_lookup(*self.io.lookups.pop(0), "fail")
                while self.io.jobs:
                    job = self.io.jobs.pop(0)
                    job.future.set_result(
                        JobResult(0, job.kind, None, JobOutcome.FAILED, 0, False, 0, 0, 0.0, 0.0, "end")
                    )
                ctrl.poll_storage()
            self.queue_transfers()
            while self.queue:
                kind, item = self.queue.pop(0)
                if kind == "copy":
                    ok = not self.reads_garbage(item)
                    self.copy(item, ok)
                    self.reports.append(([item.op_id], []) if ok else ([], [item.op_id]))
                    self.in_flight.discard(item.op_id)
                    self.ended.append(item.op_id)
                else:
                    self.forward(self.reqs.get(item))
            while self.reports:
                ctrl.transfers_done(*self.reports.pop(0))
            self.failed_unheard.clear()
            for rid in list(self.reqs):
                req = self.reqs.pop(rid)
                ctrl.apply(CancelPrefetch(rid=rid))
                if req.state != "waiting":
                    ctrl.apply(Release(rid=rid))
            self.queue_transfers()
            if not self.queue and not self.reports and (self.io is None or not (self.io.lookups or self.io.jobs)):
                break
        ctrl.take_transfers()  # retries rollbacks
        event(f"copies failed: {min(ctrl.failed_transfers, 3)}+")
        if ctrl.storage is not None:
            event("storage outcomes: " + ",".join(sorted(k for k in ctrl.storage.counters.outcomes if k.startswith("prefetch"))))
        ctrl.check_invariants()
        tree = ctrl.tree
        assert sorted(self.issued) == sorted(self.ended), "an order never ended"
        assert len(self.ended) == len(set(self.ended)), "an order ended twice"
        assert not ctrl.pending and tree.usage().taints == 0
        assert tree.usage().host_pages_protected == 0 and tree.usage().host_states_protected == 0, "a host pin leaked"
        assert tree.usage().device_pages_protected == 0 and tree.usage().device_states_protected == 0
        assert ctrl.device_kv.num_free + tree.usage().device_pages_used == ctrl.device_kv.capacity
        if ctrl.host_kv is not None:
            assert ctrl.host_kv.num_free + tree.usage().host_pages_used == ctrl.host_kv.capacity


_settings = settings(
    max_examples=2 * EXAMPLES,
    stateful_step_count=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

TestControllerMachine = ControllerMachine.TestCase
TestControllerMachine.settings = _settings
