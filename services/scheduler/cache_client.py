"""The scheduler's side of the cache controller: round trips, admission, next-step needs, the lazy
track slot and its failure path, and the scheduler's copy of what each request holds.

Who owns what (the controller's `RequestAlloc` is the truth; `Req` mirrors it):

    Req.pages  = [ shared prefix ........ | own pages ............ ]
                   the tree's (locked        the request's (allocated at admission and by Extend;
                   by the request: KV)       re-pointed to the tree's copy when an Insert dedups)
    Req.slots  = [ working, *track, *capture ]
                   working: the request's live state; track: mamba_track.py; capture: planned at
                   admission, given to the tree by an Insert once the prefill wrote them.

A slot or page leaves the request only by an op the controller checks (Insert, FreeSlots,
Release): one naming a slot or page the request does not hold is refused, never obeyed.

Admission checks before it acts: the controller admits a request only if what it needs is free or
evictable, and stops at the first that does not fit (FCFS). A refused head is not retried until
something that could make room has happened (`epoch`): a release, a freed slot, an insert, a
finished prefetch. So a waiting head that cannot fit costs no eviction and no round trip per step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import NamedTuple

from himamba.common.messages import (
    Admit,
    Admitted,
    AllocSlots,
    CacheOp,
    CacheResult,
    CacheStep,
    CacheStepDone,
    CancelPrefetch,
    Extend,
    Extended,
    FreeSlots,
    Insert,
    Inserted,
    Release,
    Released,
    SlotsAllocated,
    SlotsFreed,
    Transfer,
)
from himamba.common.metrics import SCHEDULER_LAZY_ALLOC_FAILURES
from himamba.common.metrics_report import ServiceMetrics
from himamba.common.transport import Outbox
from himamba.services.scheduler import mamba_track
from himamba.services.scheduler.batching import BatchPlan
from himamba.services.scheduler.request import Req
from himamba.services.scheduler.round_trips import RoundTrips

_FREES = (Release, FreeSlots, Insert, CancelPrefetch)  # ops after which an admission may fit again


class Applied(NamedTuple):
    """What one CacheStep's results changed for the scheduler's lifecycle."""

    admitted: list[tuple[Req, Admitted]]
    refused: Admitted | None  # the first Admit that did not fit: the head of the queue waits


class CacheClient:
    """Ops for the cache controller, the CacheStep round trip, and the results applied to requests."""

    def __init__(
        self,
        outbox: Outbox,
        trips: RoundTrips,
        *,
        strategy: mamba_track.Strategy,
        interval: int,
        page_size: int,
        use_cache: bool,
        fail_lazy_alloc: bool,
        metrics: ServiceMetrics,
        log: logging.Logger,
    ) -> None:
        self.outbox = outbox
        self.trips = trips
        self.strategy = strategy
        self.interval = interval
        self.page_size = page_size
        self.use_cache = use_cache
        self.fail_lazy_alloc = fail_lazy_alloc
        self.m = metrics
        self.log = log
        self.cache_pid = 0  # the controller the ops are meant for
        self.pending_ops: list[CacheOp] = []
        self.pending_transfers: list[Transfer] = []
        self.epoch = 0  # bumped by anything that may let a refused admission fit
        self._refused_epoch = -1  # the epoch the last refusal was decided at
        self._reserving: dict[str, list[str]] = {}  # Admit rid -> siblings it reserves for
        # PrefetchDone can overtake the CacheStepDone that said "prefetching" (the reply is applied
        # when the awaiting coroutine resumes): remembered here so that wait is not entered.
        self.prefetch_done: set[str] = set()

    # ------------------------------------------------------------ ops and the round trip

    def queue(self, op: CacheOp) -> None:
        """An op for the next CacheStep."""
        self.pending_ops.append(op)
        if isinstance(op, _FREES):
            self.epoch += 1

    def memory_changed(self) -> None:
        """Something outside the ops may let a refused admission fit (a prefetch finished, a
        request became eligible, the controller was reset)."""
        self.epoch += 1

    def take_pending(self) -> list[CacheOp]:
        ops, self.pending_ops = self.pending_ops, []
        return ops

    async def step(self, ops: list[CacheOp], requests: dict[str, Req]) -> Applied:
        """One CacheStep round trip; its results are applied to `requests`."""
        step_id = self.trips.next_id()
        sent_epoch = self.epoch
        reply = await self.trips.call(
            self.outbox, CacheStep(step_id=step_id, ops=ops, cache_pid=self.cache_pid), step_id, CacheStepDone
        )
        done, _ = await reply.wait()
        self.pending_transfers.extend(done.transfers)
        return self._apply(list(done.results), requests, sent_epoch)

    # ------------------------------------------------------------ admission

    def admissions(self, waiting: Iterable[Req], room: int, requests: dict[str, Req], num_slots: int) -> list[Admit]:
        """Admits for the head of the queue, FCFS, up to `room`; none while the last refusal
        stands (nothing has changed since)."""
        if room <= 0 or self._refused_epoch == self.epoch:
            return []
        ops: list[Admit] = []
        for req in waiting:
            if len(ops) >= room:
                break
            if req.prefetching or self._held(req, requests):
                continue
            reserve = [
                r
                for r in req.siblings
                if (s := requests.get(r)) is not None and s.status == "waiting" and not s.reserved
            ]
            if reserve:
                self._reserving[req.rid] = reserve
            ops.append(
                Admit(
                    rid=req.rid,
                    tokens=req.context,
                    num_slots=num_slots,
                    # Prompt logprobs need every prompt position's logits: no prefix-cache match.
                    use_cache=self.use_cache and req.sampling.prompt_logprobs is None,
                    reserve=reserve,
                )
            )
        return ops

    @staticmethod
    def _held(req: Req, requests: dict[str, Req]) -> bool:
        """A sibling sample waits until sample 0's prefill is done (it then hits the prompt)."""
        if not req.first:
            return False
        first = requests.get(req.first)
        return first is not None and first.status != "finished" and not first.output_ids

    # ------------------------------------------------------------ next-step needs

    def predict_next(self, plan: BatchPlan) -> list[CacheOp]:
        """Pages and lazy track slots the requests of `plan` will need in the step after it."""
        ops: list[CacheOp] = []
        ps, interval = self.page_size, self.interval
        for req, n in plan.items:
            after = req.computed_len + n
            if after < req.context_len:
                continue  # still prefilling: pages were allocated at admission
            if len(req.pages) * ps < after + 1:
                ops.append(Extend(rid=req.rid, total_len=after + 1))
            if (after + 1) % interval == 0:
                ops += self.lazy_slot_ops(req, after + 1)
        return ops

    def decode_needs(self, plan: BatchPlan) -> list[CacheOp]:
        """What a decode step still lacks (the overlap window did not get it)."""
        ops: list[CacheOp] = []
        if plan.mode != "decode":
            return ops
        ps, interval = self.page_size, self.interval
        for req, _ in plan.items:
            if len(req.pages) * ps < req.computed_len + 1:
                ops.append(Extend(rid=req.rid, total_len=req.computed_len + 1))
            if (req.computed_len + 1) % interval == 0:
                ops += self.lazy_slot_ops(req, req.computed_len + 1)
        return ops

    def lazy_slot_ops(self, req: Req, context_after_step: int) -> list[CacheOp]:
        """The lazy strategy's boundary slot, asked for just before the boundary step."""
        if not mamba_track.is_boundary(context_after_step, self.interval) or not mamba_track.needs_boundary_slot(
            req, self.strategy
        ):
            return []
        if self.fail_lazy_alloc:
            self.lazy_failed(req)
            return []
        return [AllocSlots(rid=req.rid, num=1)]

    def lazy_failed(self, req: Req) -> None:
        """No slot for this boundary: it tracks nothing, the older tracked state stays the one the
        tree gets at the finish, and the next boundary asks again."""
        self.m[SCHEDULER_LAZY_ALLOC_FAILURES].inc()
        self.log.info(
            "%s: no slot for its lazy track buffer at this boundary; keeping the state tracked at %d",
            req.rid,
            req.last_track_len,
        )

    # ------------------------------------------------------------ results

    def _apply(self, results: list[CacheResult], requests: dict[str, Req], sent_epoch: int) -> Applied:
        admitted: list[tuple[Req, Admitted]] = []
        refused: Admitted | None = None
        for res in results:
            req = requests.get(res.rid)
            if isinstance(res, Admitted):
                reserve = self._reserving.pop(res.rid, [])
                if req is None or req.status != "waiting":
                    if res.ok:  # gone meanwhile (aborted): give back what it got
                        self.queue(Release(rid=res.rid))
                        for r in reserve:
                            self.queue(Release(rid=r))
                    continue
                if res.prefetching:
                    if res.rid in self.prefetch_done:
                        self.prefetch_done.discard(res.rid)  # already over: try again next step
                        self.memory_changed()
                    else:
                        req.prefetching = True
                elif res.ok:
                    for r in reserve:
                        sibling = requests.get(r)
                        if sibling is not None and sibling.status == "waiting":
                            sibling.reserved = True
                        else:
                            self.queue(Release(rid=r))  # gone meanwhile: free its reservation
                    admitted.append((req, res))
                elif not res.blocked and refused is None:
                    refused = res
                    self._refused_epoch = sent_epoch
                continue
            if isinstance(res, (Inserted, Extended, SlotsAllocated, SlotsFreed, Released)) and res.error:
                self.log.error("cache controller refused an op of %s: %s", res.rid, res.error)
            if req is None or req.status != "running":
                continue
            if isinstance(res, Inserted) and res.ok and res.pages:
                n = len(res.pages)
                if req.pages[:n] != res.pages:
                    first = next(i for i, (a, b) in enumerate(zip(req.pages, res.pages)) if a != b)
                    req.pages[:n] = res.pages
                    req.pages_dirty = min(req.pages_dirty, first)
            elif isinstance(res, Extended) and res.ok:
                req.pages.extend(res.new_pages)
            elif isinstance(res, SlotsAllocated):
                if res.ok:
                    req.slots.extend(res.slots)
                    req.track_slots.extend(res.slots)
                elif self.strategy == "extra_buffer_lazy" and not res.error:
                    self.lazy_failed(req)
        return Applied(admitted, refused)

    # ------------------------------------------------------------ the end of a request

    def release_op(self, req: Req, reason: str) -> Release:
        """What the tree gets from a finished request (see mamba_track.py for the strategies)."""
        if not self.use_cache or reason in ("abort", "error") or self.strategy == "no_buffer":
            return Release(rid=req.rid)  # no_buffer: decoded text is not cached
        done = req.computed_len
        if done % self.page_size == 0 and done > max(req.last_track_len, req.last_state_len) and req.slots:
            return Release(rid=req.rid, tokens=req.tokens(0, done), slot=req.working_slot)
        if req.newest_track_slot is not None and req.last_track_len > req.last_state_len:
            return Release(rid=req.rid, tokens=req.tokens(0, req.last_track_len), slot=req.newest_track_slot)
        return Release(rid=req.rid)
