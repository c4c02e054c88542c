"""SchedulerService: the request lifecycle loop.

One step: pick a batch (batching.py), make sure its requests have the pages and track slots
the step needs, send RunBatch to the worker, and turn BatchDone into tokens for the tokenizer,
captured states into tree inserts, and finished requests into releases. Cache work for the
next step (flushing inserts and releases, admitting waiting requests, pages for the next
decode, lazy track slots for the next boundary) is one CacheStep round trip; with overlap on
it runs while the worker computes the current step. The scheduler never touches a tensor and
never owns memory: it asks the cache controller, which answers with pages, slots and copy orders.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections import deque
from typing import Any

import torch

from himamba.common.config import Config
from himamba.common.messages import (
    AbortRequest,
    AddRequest,
    Admit,
    Admitted,
    AllocSlots,
    BatchDone,
    CacheOp,
    CacheReset,
    CacheStep,
    CacheStepDone,
    CancelPrefetch,
    Extend,
    Extended,
    FreeSlots,
    Hello,
    Insert,
    Inserted,
    Prefetch,
    Ready,
    Release,
    RunBatch,
    SeqPlan,
    Shutdown,
    SlotsAllocated,
    StopRequest,
    TokenBatch,
    TokenOut,
    ToScheduler,
    Transfer,
    WorkerInfo,
)
from himamba.common.metrics import (
    SCHEDULER_LAZY_ALLOC_FAILURES,
    SCHEDULER_MAMBA_TRACK_SLOTS,
    SCHEDULER_QUEUE_TIME,
    SCHEDULER_RETRACTIONS,
    SCHEDULER_RUNNING,
    SCHEDULER_WAITING,
)
from himamba.common.metrics_report import MetricsReporter, ServiceMetrics
from himamba.common.transport import Outbox
from himamba.common.types import CachedTokens, FinishReason
from himamba.common.wire import tensor_ref
from himamba.services.actor import Actor
from himamba.services.scheduler import mamba_track
from himamba.services.scheduler.batching import BatchPlan, pick_batch
from himamba.services.scheduler.request import Req
from himamba.services.scheduler.stop import check_stop
from himamba.services.scheduler.validation import validate_against_worker


class WorkerRestarted(Exception):
    """An in-flight round trip that will never be answered: the worker restarted."""


class SchedulerService(Actor[ToScheduler]):
    name = "scheduler"

    def __init__(self, cfg: Config):
        super().__init__(cfg, cfg.endpoints.scheduler_ipc, ToScheduler)  # type: ignore[arg-type]
        self.worker = Outbox(self.ctx, cfg.endpoints.worker_ipc)
        self.cache = Outbox(self.ctx, cfg.endpoints.cache_ipc)
        self.tokenizer = Outbox(self.ctx, cfg.endpoints.tokenizer_ipc)
        self.info: WorkerInfo | None = None
        self.reporter = MetricsReporter("scheduler", self.tokenizer, cfg.metrics.report_interval_s)
        self.m = self.reporter.metrics
        self.reporter.on_collect(self._collect_metrics)
        self.page_size = cfg.cache.page_size
        self.use_cache = not cfg.cache.disable_radix_cache
        self.storage = getattr(cfg.cache, "hicache_storage_backend", "none") != "none"
        sc = cfg.scheduler
        # Track slots only make sense when states can go into a tree.
        self.strategy: mamba_track.Strategy = sc.mamba_scheduler_strategy if self.use_cache else "no_buffer"
        self.interval = sc.mamba_track_interval
        self.overlap = not sc.disable_overlap
        self.requests: dict[str, Req] = {}
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.pending_ops: list[CacheOp] = []
        self.pending_transfers: list[Transfer] = []
        self.wake = asyncio.Event()
        self._ids = itertools.count(1)
        self._replies: dict[int, asyncio.Future[Any]] = {}
        self.last_mode: str | None = None
        self._info_ready = asyncio.Event()
        self.counters = {"lazy_alloc_failures": 0, "admission_blocked": 0, "retractions": 0}
        self._restarts = 0  # WorkerInfo messages after the first (the worker came back)
        self._resets = 0  # CacheReset confirmations from the cache controller
        self._cache_pid = 0  # the cache controller that answered our Hello (0: none yet)
        self._refused_rid = ""  # the waiting head, when the last admission attempt refused it
        self._refused_reason = ""

    # ------------------------------------------------------------ inbox

    async def handle(self, msg: ToScheduler, frames: list[Any]) -> None:
        match msg:
            case AddRequest():
                self.on_add(msg)
            case AbortRequest(rid=rid):
                self.on_abort(rid, stop=False)
            case StopRequest(rid=rid):
                self.on_abort(rid, stop=True)
            case BatchDone(batch_id=i) | CacheStepDone(step_id=i):
                fut = self._replies.pop(i, None)
                if fut is not None and not fut.done():
                    fut.set_result((msg, frames))
            case WorkerInfo():
                self.on_worker_info(msg)
            case CacheReset(reason="worker_restarted"):
                self._resets += 1
                # Anything a racing Admit allocated in the fresh controller is given back.
                self.pending_ops = [Release(rid=r.rid) for r in self.waiting]
                self._update_ready()
            case CacheReset(reason="cache_started", cache_pid=pid) if pid != self._cache_pid:
                await self._on_cache_started(pid)
            case CacheReset(reason="scheduler_started", scheduler_pid=mine, cache_pid=pid) if mine == os.getpid():
                if pid != self._cache_pid:
                    self._cache_pid = pid
                    self.log.info("cache controller ready (pid %d)", pid)
                    self._update_ready()
            case CacheReset():
                pass  # a repeat, or the answer to another scheduler's Hello
            case Shutdown():
                pass
        self.wake.set()

    async def _on_cache_started(self, pid: int) -> None:
        """A new cache controller: what we held in an earlier one is gone. Requeue what ran, and
        greet it; scheduling resumes when it answers."""
        if self._cache_pid or self.running:
            self.log.warning("cache controller restarted (pid %d): requeueing %d running requests", pid, len(self.running))
            self._requeue_running()
            if self.use_cache and self.storage:
                self.pending_ops = [Prefetch(rid=r.rid, tokens=r.prompt_ids) for r in self.waiting]
            else:
                self.pending_ops = []
        self._cache_pid = 0
        self._update_ready()
        await self.cache.send(Hello(service=self.name, pid=os.getpid()))

    def on_worker_info(self, info: WorkerInfo) -> None:
        if self.info is not None and info.pid and info.pid == self.info.pid:
            return  # a repeat (the answer to our Hello)
        if self.info is not None:
            self._restarts += 1
            self._on_worker_restart()
            self.info = info
            self._update_ready()  # scheduling resumes once the cache controller has reset too
            return
        problem = validate_against_worker(self.cfg, info, self.strategy)
        if problem:
            self._fatal(f"configuration does not fit the model: {problem}")
            return
        self.info = info
        self._update_ready()
        self.log.info(
            "worker ready: vocab %d, %d pages, %d state slots; strategy %s, track interval %d, overlap %s",
            info.vocab_size, info.num_pages, info.num_state_slots, self.strategy, self.interval, self.overlap,
        )

    def _update_ready(self) -> None:
        if self.info is not None and self._resets >= self._restarts and self._cache_pid:
            self._info_ready.set()
        else:
            self._info_ready.clear()

    def _on_worker_restart(self) -> None:
        """The worker came back with empty pools: requeue every running request (its output is
        kept and recomputed) and drop memory bookkeeping the reset cache no longer knows."""
        self.log.warning("worker restarted: requeueing %d running requests", len(self.running))
        self._requeue_running()
        # Give back whatever a racing Admit got from a controller that has already reset
        # (releasing a request the controller does not know is a no-op).
        self.pending_ops = [Release(rid=r.rid) for r in self.waiting]

    def _requeue_running(self) -> None:
        """Every running request goes back to the head of the queue (its output is kept and
        recomputed); replies still awaited from the worker or cache will never be used."""
        for key, fut in list(self._replies.items()):
            if not fut.done():
                fut.set_exception(WorkerRestarted())
            del self._replies[key]
        for req in reversed(list(self.running)):
            self.running.remove(req)
            req.release_resources()
            req.status = "waiting"
            self.waiting.appendleft(req)
        self.pending_transfers = []

    def on_add(self, msg: AddRequest) -> None:
        if msg.rid in self.requests:
            # The front door sends a request again when it cannot tell whether a restarted
            # scheduler received it (internal rids are unique): the copy is dropped.
            self.log.debug("request %s is already here", msg.rid)
            return
        eos = set(msg.eos_token_ids)
        if self.info is not None:
            eos |= set(self.info.eos_token_ids)
        req = Req(msg.rid, list(msg.input_ids), msg.sampling, msg.max_tokens, frozenset(eos))
        self.requests[req.rid] = req
        self.waiting.append(req)
        if self.use_cache and self.storage:
            self.pending_ops.append(Prefetch(rid=req.rid, tokens=req.prompt_ids))

    def on_abort(self, rid: str, stop: bool) -> None:
        req = self.requests.get(rid)
        if req is None:
            return
        if stop:
            req.stop_requested = True
        else:
            req.abort_requested = True

    def _emit_now(self, out: TokenOut) -> None:
        asyncio.get_running_loop().create_task(self.tokenizer.send(TokenBatch(outs=[out])))

    # ------------------------------------------------------------ round trips

    async def _call(self, outbox: Outbox, msg: Any, key: int, tensors: list[torch.Tensor] | None = None) -> Any:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._replies[key] = fut
        await outbox.send(msg, tensors or [])
        return fut

    async def cache_step(self, ops: list[CacheOp]) -> list[Any]:
        step_id = next(self._ids)
        step = CacheStep(step_id=step_id, ops=ops, cache_pid=self._cache_pid)
        reply, _ = await (await self._call(self.cache, step, step_id))
        self.pending_transfers.extend(reply.transfers)
        return list(reply.results)

    # ------------------------------------------------------------ the loop

    def _collect_metrics(self, m: ServiceMetrics) -> None:
        m[SCHEDULER_RUNNING].set(len(self.running))
        m[SCHEDULER_WAITING].set(len(self.waiting))
        m[SCHEDULER_MAMBA_TRACK_SLOTS].labels(strategy=self.strategy).set(sum(len(r.track_slots) for r in self.running))

    async def background(self) -> None:
        # Peers that are already up sent what we need to an earlier scheduler: ask again.
        hello = Hello(service=self.name, pid=os.getpid())
        await self.worker.send(hello)
        await self.cache.send(hello)
        if not self._info_ready.is_set():
            self.log.info("waiting for the worker (model load and pool sizes) and the cache controller")
        await self._info_ready.wait()
        await self.tokenizer.send(Ready(service=self.name, pid=os.getpid()))
        self.spawn(self.reporter.run(), "metrics")
        while True:
            await self._info_ready.wait()
            # Cleared before the step, so a message arriving during it is never missed.
            self.wake.clear()
            try:
                progressed = await self.step()
            except WorkerRestarted:
                continue
            if not progressed:
                await self.wake.wait()

    async def step(self) -> bool:
        outs: list[TokenOut] = []
        self._reap(outs)
        cache_progress = False
        if not self.overlap or not self.running:
            cache_progress = await self._cache_work(None)
        plan = pick_batch(self.running, self.cfg.scheduler.chunked_prefill_size, self.last_mode)
        if plan is not None:
            plan = await self._prepare(plan)
        if plan is None:
            if self.pending_transfers:
                await self._run_transfers_only()
            head = self.waiting[0] if self.waiting else None
            if head is not None and not self.running and not self.pending_ops and head.rid == self._refused_rid:
                # Nothing runs, nothing is left to free, and the head was just refused: it can
                # never fit. Answer instead of waiting forever.
                self._finish(head, "error", outs, error=f"the request does not fit in the memory pools ({self._refused_reason})")
            await self._flush(outs)
            return cache_progress or bool(self.pending_ops)
        done_fut = await self._send_batch(plan)
        if self.overlap:
            # Prepare the next step (admissions, inserts, releases, pages) while the worker runs.
            await self._cache_work(plan)
        done, _ = await done_fut
        self._on_batch_done(plan, done, outs)
        await self._flush(outs)
        return True

    async def _flush(self, outs: list[TokenOut]) -> None:
        if outs:
            await self.tokenizer.send(TokenBatch(outs=outs))

    # ------------------------------------------------------------ cache work

    async def _cache_work(self, current: BatchPlan | None) -> bool:
        """One CacheStep: pending inserts/releases, admissions, and (with a batch in flight)
        the pages and lazy track slots its requests will need in the next step."""
        ops = self.pending_ops + self._plan_admissions()
        self.pending_ops = []
        if current is not None:
            ops += self._predict_next(current)
        if not ops:
            return False
        results = await self.cache_step(ops)
        return self._apply_cache_results(results)

    def _predict_next(self, plan: BatchPlan) -> list[CacheOp]:
        ops: list[CacheOp] = []
        for req, n in plan.items:
            after = req.computed_len + n
            if after < req.context_len:
                continue  # still prefilling: pages were allocated at admission
            # The next step decodes one token at position `after`.
            if len(req.pages) * self.page_size < after + 1:
                ops.append(Extend(rid=req.rid, total_len=after + 1))
            ops += self._lazy_alloc_ops(req, after + 1)
        return ops

    def _lazy_alloc_ops(self, req: Req, context_after_step: int) -> list[CacheOp]:
        if (
            self.strategy != "extra_buffer_lazy"
            or not mamba_track.is_boundary(context_after_step, self.interval)
            or len(req.track_slots) != 1
            or not req.insert_ok
        ):
            return []
        if self.cfg.scheduler.debug_fail_lazy_alloc:
            self._lazy_failed(req)
            return []
        return [AllocSlots(rid=req.rid, num=1)]

    def _lazy_failed(self, req: Req) -> None:
        self.counters["lazy_alloc_failures"] += 1
        self.m[SCHEDULER_LAZY_ALLOC_FAILURES].inc()
        req.insert_ok = False
        self.log.info("%s: no slot for its lazy track buffer; it will not be cached", req.rid)

    def _plan_admissions(self) -> list[CacheOp]:
        ops: list[CacheOp] = []
        room = self.cfg.scheduler.max_running_requests - len(self.running)
        num_slots = 1 + mamba_track.track_slots_at_admission(self.strategy)
        for req in itertools.islice(self.waiting, max(room, 0)):
            ops.append(Admit(rid=req.rid, tokens=req.context, num_slots=num_slots, use_cache=self.use_cache))
        return ops

    def _apply_cache_results(self, results: list[Any]) -> bool:
        self._refused_rid = ""
        progressed = False
        blocked = False
        for res in results:
            req = self.requests.get(res.rid)
            if isinstance(res, Admitted):
                if req is None or req.status != "waiting":
                    if res.ok:  # aborted meanwhile
                        self.pending_ops.append(Release(rid=res.rid))
                    continue
                if res.prefetching and not blocked:
                    continue  # its prefix is still arriving from storage: try the ones behind it
                if not res.ok or blocked:
                    # FCFS: a request that does not fit blocks the ones behind it this step.
                    if not blocked:
                        self.counters["admission_blocked"] += 1
                        self._refused_rid, self._refused_reason = res.rid, res.reason
                    blocked = True
                    if res.ok:
                        self.pending_ops.append(Release(rid=res.rid))
                    continue
                self._on_admitted(req, res)
                progressed = True
            elif req is None or req.status != "running":
                continue
            elif isinstance(res, Inserted) and res.pages:
                req.pages[: len(res.pages)] = res.pages
            elif isinstance(res, Extended) and res.ok:
                req.pages.extend(res.new_pages)
            elif isinstance(res, SlotsAllocated) and res.slots:
                req.slots.extend(res.slots)
                req.track_slots.extend(res.slots)
            elif isinstance(res, SlotsAllocated) and not res.ok:
                if self.strategy == "extra_buffer_lazy" and len(req.track_slots) == 1:
                    self._lazy_failed(req)  # the boundary's second slot could not be had
        return progressed

    def _on_admitted(self, req: Req, res: Admitted) -> None:
        self.waiting.remove(req)
        if req.num_retractions == 0 and req.cached is None:
            self.m[SCHEDULER_QUEUE_TIME].observe(time.monotonic() - req.arrival)
        req.status = "running"
        req.pages = list(res.pages)
        req.slots = list(res.slots)
        k = mamba_track.track_slots_at_admission(self.strategy)
        req.track_slots = list(res.slots[1 : 1 + k])
        req.computed_len = res.cached_len
        req.last_state_len = res.cached_len
        req.pending_captures = [(int(pos), int(slot)) for pos, slot in res.captures]
        if res.state_src is not None and res.cached_len > 0:
            req.state_init, req.state_src = "copy", res.state_src
        else:
            req.state_init = "zero"
        if req.cached is None:
            req.cached = res.cached
        self.running.append(req)

    # ------------------------------------------------------------ building a step

    async def _prepare(self, plan: BatchPlan) -> BatchPlan | None:
        """Pages for decode requests and lazy track slots that the overlap window did not get."""
        ops: list[CacheOp] = []
        for req, n in plan.items:
            if plan.mode == "decode":
                if len(req.pages) * self.page_size < req.computed_len + 1:
                    ops.append(Extend(rid=req.rid, total_len=req.computed_len + 1))
                ops += self._lazy_alloc_ops(req, req.computed_len + 1)
        if ops:
            results = await self.cache_step(ops)
            self._apply_cache_results(results)
        short = [q for q, _ in plan.items if len(q.pages) * self.page_size < q.computed_len + (1 if plan.mode == "decode" else 0)]
        if short:
            # Out of KV pages even after eviction: retract the newest requests (their output is
            # kept) and let the rest go on.
            for req in sorted(short, key=lambda q: q.arrival, reverse=True):
                self._retract(req)
        items = [(q, n) for q, n in plan.items if q.status == "running"]
        return BatchPlan(plan.mode, items) if items else None

    def _retract(self, req: Req) -> None:
        self.counters["retractions"] += 1
        self.log.info("retracting %s (out of KV pages), %d generated tokens kept", req.rid, len(req.output_ids))
        self.running.remove(req)
        self.pending_ops.append(Release(rid=req.rid))
        req.release_resources()
        req.status = "waiting"
        req.num_retractions += 1
        self.m[SCHEDULER_RETRACTIONS].inc()
        self.waiting.appendleft(req)

    async def _run_transfers_only(self) -> None:
        batch_id = next(self._ids)
        msg = RunBatch(batch_id=batch_id, mode="none", seqs=[], transfers=self.pending_transfers)
        self.pending_transfers = []
        await (await self._call(self.worker, msg, batch_id))

    def _captures_for(self, req: Req, mode: str, n: int) -> list[tuple[str, int, int]]:
        """(kind, context position, slot) of every state this step must capture for `req`."""
        start = req.computed_len
        caps = [("admit", pos, slot) for pos, slot in req.pending_captures if start < pos <= start + n]
        if mode == "decode":
            if mamba_track.is_boundary(start + 1, self.interval) and req.insert_ok:
                slot = mamba_track.decode_capture_slot(req, self.strategy)
                if slot is not None:
                    caps.append(("track", start + 1, slot))
        else:
            slot = self._chunk_capture_slot(req, n)
            if slot is not None:
                caps.append(("chunk", start + n, slot))
        return caps

    def _chunk_capture_slot(self, req: Req, n: int) -> int | None:
        """A track slot to checkpoint a non-final, page-aligned prefill chunk into (donated to
        the tree afterwards, so concurrent requests with the same prefix can hit it)."""
        end = req.computed_len + n
        if self.strategy == "no_buffer" or end >= req.context_len or end % self.page_size or end <= req.last_state_len:
            return None
        if any(pos == end for pos, _ in req.pending_captures):
            return None
        free = [s for s in req.track_slots if s != req.newest_track_slot]
        return free[0] if free else None

    async def _send_batch(self, plan: BatchPlan) -> Any:
        seqs: list[SeqPlan] = []
        ids: list[int] = []
        pages: list[int] = []
        caps: dict[str, list[tuple[str, int, int]]] = {}
        for req, n in plan.items:
            start = req.computed_len
            ctx = req.context
            caps[req.rid] = self._captures_for(req, plan.mode, n)
            ids.extend(ctx[start : start + n])
            npages = -(-(start + n) // self.page_size)
            pages.extend(req.pages[:npages])
            p = req.sampling
            penalised = p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
            seqs.append(
                SeqPlan(
                    rid=req.rid,
                    prefix_len=start,
                    new_len=n,
                    num_pages=npages,
                    state_slot=req.working_slot,
                    state_init=req.state_init,
                    state_src=req.state_src,
                    captures=[(pos - start, slot) for _, pos, slot in caps[req.rid]],
                    sampling=req.sampling,
                    step=len(req.output_ids),
                    history=ctx if penalised else [],
                    num_prompt=len(req.prompt_ids),
                )
            )
        ids_t = torch.tensor(ids, dtype=torch.int64)
        pages_t = torch.tensor(pages, dtype=torch.int64)
        batch_id = next(self._ids)
        msg = RunBatch(
            batch_id=batch_id,
            mode=plan.mode,
            seqs=seqs,
            input_ids=tensor_ref(ids_t, 0),
            pages=tensor_ref(pages_t, 1),
            transfers=self.pending_transfers,
        )
        self.pending_transfers = []
        self.last_mode = plan.mode
        self._in_flight = caps
        return await self._call(self.worker, msg, batch_id, [ids_t, pages_t])

    # ------------------------------------------------------------ results

    def _on_batch_done(self, plan: BatchPlan, done: BatchDone, outs: list[TokenOut]) -> None:
        if done.error:
            for req, _ in plan.items:
                if req.status == "running":
                    self._finish(req, "error", outs, error=done.error)
            return
        now = time.monotonic()
        for i, (req, n) in enumerate(plan.items):
            if req.status != "running":
                continue
            req.state_init = "keep"
            req.computed_len += n
            self._commit_captures(req, self._in_flight.get(req.rid, []))
            if req.abort_requested:
                self._finish(req, "abort", outs)
                continue
            if req.computed_len < req.context_len:
                continue  # a prefill chunk that did not reach the end: no token yet
            token = done.next_tokens[i]
            req.output_ids.append(token)
            if done.logprobs is not None:
                req.logprobs.append(done.logprobs[i])
            if req.first_token_time is None:
                req.first_token_time = now
            reason = check_stop(req, self.cfg.model.max_context_len)
            outs.append(
                TokenOut(
                    rid=req.rid,
                    token_ids=[token],
                    logprobs=[done.logprobs[i]] if done.logprobs is not None else None,
                    finish_reason=reason,
                    prompt_tokens=len(req.prompt_ids),
                    completion_tokens=len(req.output_ids),
                    cached=self._cached_once(req),
                )
            )
            if reason is not None:
                self._finish(req, reason, outs, emitted=True)

    def _commit_captures(self, req: Req, captures: list[tuple[str, int, int]]) -> None:
        """The forward that wrote these states has completed: now the tree may have them."""
        for kind, pos, slot in captures:
            if kind == "admit":
                req.pending_captures.remove((pos, slot))
                req.slots.remove(slot)
                self.pending_ops.append(Insert(rid=req.rid, tokens=req.context[:pos], slot=slot))
                req.last_state_len = max(req.last_state_len, pos)
            elif kind == "chunk":
                # Donate the track slot to the tree and ask for a fresh one in its place.
                req.track_slots.remove(slot)
                req.slots.remove(slot)
                req.next_track = 0
                self.pending_ops.append(Insert(rid=req.rid, tokens=req.context[:pos], slot=slot))
                self.pending_ops.append(AllocSlots(rid=req.rid, num=1))
                req.last_state_len = max(req.last_state_len, pos)
            else:
                for freed in mamba_track.after_boundary(req, self.strategy, slot, pos):
                    req.slots.remove(freed)
                    self.pending_ops.append(FreeSlots(rid=req.rid, slots=[freed]))

    def _cached_once(self, req: Req) -> CachedTokens | None:
        if req.cached_reported:
            return None
        req.cached_reported = True
        return req.cached or CachedTokens()

    def _reap(self, outs: list[TokenOut]) -> None:
        """Finish requests that were aborted or stopped (by stop string) since the last step."""
        for req in list(self.waiting):
            if req.abort_requested or req.stop_requested:
                self._finish(req, "abort" if req.abort_requested else "stop", outs)
        for req in list(self.running):
            if req.abort_requested or req.stop_requested:
                self._finish(req, "abort" if req.abort_requested else "stop", outs)

    def _release_op(self, req: Req, reason: str) -> Release:
        """What the tree gets from a finished request (see mamba_track.py for the strategies)."""
        if not self.use_cache or reason in ("abort", "error") or not req.insert_ok:
            return Release(rid=req.rid)
        if self.strategy == "no_buffer":
            return Release(rid=req.rid)  # decoded text is not cached
        done = req.computed_len
        if done % self.page_size == 0 and done > max(req.last_track_len, req.last_state_len) and req.slots:
            return Release(rid=req.rid, tokens=req.context[:done], slot=req.working_slot)
        if req.newest_track_slot is not None and req.last_track_len > req.last_state_len:
            return Release(rid=req.rid, tokens=req.context[: req.last_track_len], slot=req.newest_track_slot)
        return Release(rid=req.rid)

    def _finish(self, req: Req, reason: FinishReason, outs: list[TokenOut], emitted: bool = False, error: str = "") -> None:
        if req.status == "running":
            self.running.remove(req)
            self.pending_ops.append(self._release_op(req, reason))
        elif req.status == "waiting":
            self.waiting.remove(req)
            if self.use_cache and self.storage:
                self.pending_ops.append(CancelPrefetch(rid=req.rid))
        req.status = "finished"
        req.finish_reason = reason
        if not emitted:
            outs.append(
                TokenOut(
                    rid=req.rid,
                    token_ids=[],
                    finish_reason=reason,
                    prompt_tokens=len(req.prompt_ids),
                    completion_tokens=len(req.output_ids),
                    cached=self._cached_once(req),
                    error=error,
                )
            )
        del self.requests[req.rid]
        self.wake.set()
