"""Hypothesis state machine over the cache controller, driven as the scheduler drives it, with the
orders the scheduler may get wrong or late: admissions in FCFS steps (some that cannot fit), n > 1
reservations, prompt checkpoints inserted after their "forward", pages and lazy slots for decode,
slots freed or donated that the request does not hold, releases with inserts, and copy orders
acknowledged late and out of order.

After every step `check_invariants()` runs. A refused admission must have changed nothing (no
page or slot allocated, nothing evicted, no hit counted, no request added); a refused op naming a
foreign slot must leave every pool as it was; an ok result is of the op's result type.

HIMAMBA_HYPOTHESIS_EXAMPLES (default 60) sets the number of runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from himamba.common.config import CacheConfig
from himamba.common.messages import (
    RESULT_OF,
    Admit,
    Admitted,
    AllocSlots,
    CacheOp,
    Extend,
    FreeSlots,
    Insert,
    Release,
)
from himamba.services.cache.controller import CacheController

EXAMPLES = int(os.environ.get("HIMAMBA_HYPOTHESIS_EXAMPLES", "60"))
PS = 2


@dataclass
class Running:
    tokens: list[int]
    slots: list[int]
    captures: list[tuple[int, int]]
    length: int  # tokens with pages
    num_pages: int
    siblings: list[str] = field(default_factory=list)


def _snapshot(c: CacheController) -> tuple:
    tree = c.tree
    # Hits per token: a match may split a node (both halves keep its count), which changes no
    # token's count; a plain sum over nodes would count that split as a hit.
    hits = sum(n.hit_count * len(n.key) for n in _nodes(tree.root)) if tree is not None else 0
    return (
        c.device_kv.num_free,
        c.device_state.num_free,
        tree.usage().device_pages_used if tree else 0,
        tree.usage().device_states_used if tree else 0,
        c.host_kv.num_free if c.host_kv else 0,
        hits,
        len(c.requests),
        len(c.pending),
        tuple(sorted((k, tuple(v)) for k, v in c.reserved.items())),
    )


def _nodes(root):
    stack = [root]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children.values())


class AdmissionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.running: dict[str, Running] = {}
        self.reserved: set[str] = set()
        self.next_rid = 0

    @initialize(
        num_pages=st.integers(6, 30),
        num_slots=st.integers(3, 12),
        host=st.booleans(),
    )
    def setup(self, num_pages: int, num_slots: int, host: bool) -> None:
        cfg = CacheConfig(page_size=PS, hicache_storage_backend="none")
        self.c = CacheController(cfg, num_pages, num_slots, num_pages if host else 0, num_slots if host else 0)

    def _rid(self) -> str:
        self.next_rid += 1
        return f"r{self.next_rid}"

    def _apply(self, op: CacheOp):
        res = self.c.apply(op)
        assert type(res) is RESULT_OF[type(op)]
        return res

    def _admitted(self, rid: str, tokens: list[int], res: Admitted, siblings: list[str]) -> None:
        self.running[rid] = Running(tokens, list(res.slots), list(res.captures), len(tokens), len(res.pages), siblings)
        self.reserved.discard(rid)
        self.reserved.update(siblings)

    # ------------------------------------------------------------ admission

    @rule(
        prompts=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=14), min_size=1, max_size=3),
        num_slots=st.integers(1, 3),
        siblings=st.integers(0, 2),
    )
    def admit_step(self, prompts: list[list[int]], num_slots: int, siblings: int) -> None:
        """One CacheStep of Admits (the first may reserve for siblings): FCFS, check before act."""
        ops = []
        reserve = [self._rid() for _ in range(siblings)]
        for i, tokens in enumerate(prompts):
            ops.append(Admit(rid=self._rid(), tokens=tokens, num_slots=num_slots, reserve=reserve if i == 0 else []))
        before = _snapshot(self.c)
        results = self.c.apply_step(ops)
        assert [type(r) for r in results] == [Admitted] * len(ops)
        refused = False
        for op, res in zip(ops, results, strict=True):
            assert isinstance(res, Admitted)
            if refused:
                assert res.blocked and not res.ok
                continue
            if res.ok:
                assert len(res.pages) * PS >= len(op.tokens) and len(res.slots) >= op.num_slots
                self._admitted(op.rid, list(op.tokens), res, list(op.reserve))
            else:
                refused = True
                if res is results[0]:
                    assert _snapshot(self.c) == before, "a refused admission changed the cache"

    @precondition(lambda self: self.reserved)
    @rule(data=st.data())
    def admit_sibling(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reserved)))
        held = list(self.c.reserved[rid])
        tokens = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=10))
        res = self._apply(Admit(rid=rid, tokens=tokens, num_slots=len(held)))
        if res.ok:
            assert res.slots[: len(held)] == held  # the reserved slots, not fresh ones
            self._admitted(rid, tokens, res, [])

    @precondition(lambda self: self.reserved)
    @rule(data=st.data())
    def drop_sibling(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reserved)))
        self._apply(Release(rid=rid))
        self.reserved.discard(rid)
        assert rid not in self.c.reserved

    # ------------------------------------------------------------ running requests

    @precondition(lambda self: any(r.captures for r in self.running.values()))
    @rule(data=st.data())
    def commit_capture(self, data: st.DataObject) -> None:
        """The prefill that wrote a checkpoint completed: it goes to the tree."""
        rid = data.draw(st.sampled_from(sorted(r for r, v in self.running.items() if v.captures)))
        req = self.running[rid]
        pos, slot = req.captures.pop(0)
        res = self._apply(Insert(rid=rid, tokens=req.tokens[:pos], slot=slot))
        assert res.ok, res.error
        req.slots.remove(slot)

    @precondition(lambda self: any(len(r.tokens) >= PS for r in self.running.values()))
    @rule(data=st.data(), pages=st.integers(1, 4))
    def insert_prefix(self, data: st.DataObject, pages: int) -> None:
        """A prefix of any length (shorter than the hit the request shares with the tree, too)."""
        rid = data.draw(st.sampled_from(sorted(r for r, v in self.running.items() if len(v.tokens) >= PS)))
        req = self.running[rid]
        n = min(pages, len(req.tokens) // PS) * PS
        res = self._apply(Insert(rid=rid, tokens=req.tokens[:n], slot=None))
        assert res.ok, res.error

    @precondition(lambda self: self.running)
    @rule(data=st.data(), more=st.integers(1, 5))
    def extend(self, data: st.DataObject, more: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running[rid]
        before = _snapshot(self.c)
        res = self._apply(Extend(rid=rid, total_len=req.length + more))
        if res.ok:
            req.length += more
            req.tokens += [3] * more
            req.num_pages += len(res.new_pages)
            assert req.num_pages * PS >= req.length
        else:
            assert _snapshot(self.c) == before, "a refused Extend evicted in vain"

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def lazy_slot(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        before = _snapshot(self.c)
        res = self._apply(AllocSlots(rid=rid, num=1))
        if res.ok:
            self.running[rid].slots += res.slots
        else:
            assert _snapshot(self.c) == before, "a refused slot allocation evicted in vain"

    @precondition(lambda self: any(len(r.slots) > 1 for r in self.running.values()))
    @rule(data=st.data())
    def free_own_slot(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(r for r, v in self.running.items() if len(v.slots) > 1)))
        req = self.running[rid]
        slot = req.slots[-1]
        if any(s == slot for _, s in req.captures):
            return
        assert self._apply(FreeSlots(rid=rid, slots=[slot])).ok
        req.slots.remove(slot)

    @precondition(lambda self: len(self.running) >= 2)
    @rule(data=st.data(), kind=st.sampled_from(["free", "insert", "release"]))
    def foreign_slot_is_refused(self, data: st.DataObject, kind: str) -> None:
        """An op naming another request's slot is refused and changes nothing."""
        a, b = data.draw(st.lists(st.sampled_from(sorted(self.running)), min_size=2, max_size=2, unique=True))
        foreign = self.running[b].slots[0]
        req = self.running[a]
        before = _snapshot(self.c)
        if kind == "free":
            res = self._apply(FreeSlots(rid=a, slots=[foreign]))
            assert not res.ok and res.error and _snapshot(self.c) == before
        elif kind == "insert":
            res = self._apply(Insert(rid=a, tokens=req.tokens[: len(req.tokens) // PS * PS], slot=foreign))
            assert not res.ok and res.error and _snapshot(self.c) == before
        else:
            res = self._apply(Release(rid=a, tokens=req.tokens[: len(req.tokens) // PS * PS], slot=foreign))
            assert not res.ok and res.error  # freed, nothing inserted
            del self.running[a]
        assert foreign in self.c.requests[b].slots

    @precondition(lambda self: self.running)
    @rule(data=st.data(), insert=st.booleans(), with_slot=st.booleans())
    def release(self, data: st.DataObject, insert: bool, with_slot: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running.pop(rid)
        done = req.length - 1
        tokens = req.tokens[: done - done % PS] if insert else []
        slot = req.slots[0] if with_slot and tokens else None
        res = self._apply(Release(rid=rid, tokens=tokens, slot=slot))
        assert res.ok, res.error

    @precondition(lambda self: self.c.pending)
    @rule(data=st.data())
    def ack_copies(self, data: st.DataObject) -> None:
        """The worker acknowledges some copy orders, late and in any order."""
        ids = data.draw(st.lists(st.sampled_from(sorted(self.c.pending)), min_size=1, unique=True))
        self.c.take_transfers()
        self.c.transfers_done(ids)

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "c"):
            self.c.check_invariants()
            assert set(self.c.requests) == set(self.running)
            assert set(self.c.reserved) == self.reserved


TestAdmissionMachine = AdmissionMachine.TestCase
TestAdmissionMachine.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
)
