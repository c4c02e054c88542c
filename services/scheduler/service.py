"""SchedulerService: the request lifecycle loop.

One step: pick a batch (batching.py), make sure its requests have the pages and track slots the
step needs, send RunBatch to the worker (worker_batch.py: only what changed since the last step),
and turn BatchDone into tokens for the tokenizer, captured states into tree inserts
(captures.py), and finished requests into releases. Cache work for the next step (flushing
inserts and releases, admitting waiting requests, pages for the next decode, lazy track slots
for the next boundary) is one CacheStep round trip (cache_client.py); with overlap on it runs
while the worker computes the current step, and so does building the next decode step, which is
sent at once, for the worker to start when the current one ends (decode_ahead.py). The scheduler never touches
a tensor and never owns memory: it asks the cache controller, which answers with pages, slots
and copy orders.

Nothing polls: the loop sleeps until a message can change what it would do (a request, an
abort, a finished prefetch, a peer), and a waiting head that cannot fit is retried only after
memory was freed.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from typing import Any, NamedTuple

from himamba.common.config import Config
from himamba.common.messages import (
    AbortRequest,
    AddRequest,
    Admitted,
    BatchDone,
    CacheOp,
    CacheReset,
    CacheStepDone,
    CancelPrefetch,
    Hello,
    Prefetch,
    PrefetchDone,
    Ready,
    Release,
    RunBatch,
    Shutdown,
    StopRequest,
    TokenBatch,
    TokenLogprobs,
    TokenOut,
    ToScheduler,
    WorkerInfo,
)
from himamba.common.metrics import (
    SCHEDULER_DECODE_STEPS_AHEAD,
    SCHEDULER_MAMBA_TRACK_SLOTS,
    SCHEDULER_QUEUE_TIME,
    SCHEDULER_RETRACTIONS,
    SCHEDULER_RUNNING,
    SCHEDULER_WAITING,
)
from himamba.common.metrics_report import MetricsReporter, ServiceMetrics
from himamba.common.transport import Outbox
from himamba.common.types import CachedTokens, FinishReason
from himamba.services.actor import Actor
from himamba.services.scheduler import captures, decode_ahead, logprobs, mamba_track
from himamba.services.scheduler.batching import BatchPlan, pick_batch
from himamba.services.scheduler.cache_client import Applied, CacheClient
from himamba.services.scheduler.peers import Peers
from himamba.services.scheduler.request import Req
from himamba.services.scheduler.round_trips import Reply, RoundTrips, WorkerRestarted
from himamba.services.scheduler.stop import check_stop
from himamba.services.scheduler.worker_batch import build_run_batch


class _NewToken(NamedTuple):
    """A sampled token before its TokenOut is built (after the next RunBatch); a token without
    logprobs waits as a plain tuple of the first five fields (cheaper to make)."""

    req: Req
    token: int
    completion_tokens: int
    reason: FinishReason | None
    cached: CachedTokens | None
    token_lp: list[float] | None = None
    top_lp: list[TokenLogprobs] | None = None
    prompt_lp: list[TokenLogprobs] | None = None


def _let_the_send_go() -> None:
    """Give the CPU away once after sending a step. The send wakes ZeroMQ's I/O thread, which
    the kernel tends to place on this core, where it would wait behind the previous step's
    result handling (~1 us per running request): measured on 2 cores at 256 running, the step
    reached the worker 0.5 ms later without this. A no-op when nothing else is runnable."""
    os.sched_yield()


class _Sent(NamedTuple):
    """A step sent before the previous one's results were handled (decode_ahead.py)."""

    plan: BatchPlan  # the requests that run it
    reply: Reply[BatchDone]
    caps: dict[str, list[captures.Capture]]
    rids: frozenset[str]
    left_out: tuple[str, ...]  # the requests the worker leaves out of it (BatchDone.left_out)


class _Early(NamedTuple):
    """A step sent while the one it follows runs, not yet told which of its requests run it."""

    sent: decode_ahead.Following
    reply: Reply[BatchDone]


class SchedulerService(Actor[ToScheduler]):
    name = "scheduler"

    def __init__(self, cfg: Config):
        super().__init__(cfg, cfg.endpoints.scheduler_ipc, ToScheduler)  # type: ignore[arg-type]
        self.worker = Outbox(self.ctx, cfg.endpoints.worker_ipc)
        self.tokenizer = Outbox(self.ctx, cfg.endpoints.tokenizer_ipc)
        self.reporter = MetricsReporter("scheduler", self.tokenizer, cfg.metrics.report_interval_s)
        self.m = self.reporter.metrics
        self.reporter.on_collect(self._collect_metrics)
        self.page_size = cfg.cache.page_size
        self.use_cache = not cfg.cache.disable_radix_cache
        self.storage = cfg.cache.hicache_storage_backend != "none"
        sc = cfg.scheduler
        # Track slots only make sense when states can go into a tree.
        self.strategy: mamba_track.Strategy = sc.mamba_scheduler_strategy if self.use_cache else "no_buffer"
        self.interval = sc.mamba_track_interval
        self.overlap = not sc.disable_overlap
        self.trips = RoundTrips()
        self.cache = CacheClient(
            Outbox(self.ctx, cfg.endpoints.cache_ipc),
            self.trips,
            strategy=self.strategy,
            interval=self.interval,
            page_size=self.page_size,
            use_cache=self.use_cache,
            fail_lazy_alloc=cfg.debug.fail_lazy_alloc,
            metrics=self.m,
            log=self.log,
        )
        self.peers = Peers(
            cfg, self.cache.outbox, self.strategy, self.log, on_lost=self._on_peer_lost, on_fatal=self._fatal
        )
        self.requests: dict[str, Req] = {}
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.wake = asyncio.Event()
        self.last_mode: str | None = None
        self._to_reap: set[str] = set()  # aborted or stopped since the last step
        self._dropped: list[str] = []  # requests whose page tables the worker may forget
        self._refused: Admitted | None = None  # the waiting head, when its last admission was refused
        self._next: _Sent | None = None  # the step already sent after the one being handled
        self._peers_lost = 0  # peer restarts so far (a send that waited may have outlived one)
        # Tokens and finishes not yet sent to the front door (a new token as a plain tuple or a
        # `_NewToken` until `_flush` makes its TokenOut).
        self._outs: list[Any] = []

    # ------------------------------------------------------------ inbox

    async def handle(self, msg: ToScheduler, frames: list[Any]) -> None:
        match msg:
            case BatchDone(batch_id=i) | CacheStepDone(step_id=i):
                # A reply wakes only the coroutine that awaits it, never the loop.
                self.trips.resolve(i, msg, frames)
                return
            case AddRequest():
                self.on_add(msg)
            case AbortRequest(rid=rid):
                self.on_abort(rid, stop=False)
            case StopRequest(rid=rid):
                self.on_abort(rid, stop=True)
            case PrefetchDone(rids=rids):
                for rid in rids:
                    req = self.requests.get(rid)
                    if req is None:
                        continue
                    if req.prefetching:
                        req.prefetching = False
                    else:
                        self.cache.prefetch_done.add(rid)  # its "prefetching" answer is still on the way
                self.cache.memory_changed()
            case WorkerInfo():
                self.peers.on_worker_info(msg)
            case CacheReset():
                await self.peers.on_cache_reset(msg)
                self.cache.cache_pid = self.peers.cache_pid
            case Shutdown():
                pass
        self.wake.set()

    def _on_peer_lost(self, why: str) -> None:
        """A peer restarted: every running request goes back to the head of the queue (its output
        is kept and recomputed); replies still awaited will never be used, and memory bookkeeping
        the reset controller no longer knows is dropped."""
        if self.running:
            self.log.warning("%s: requeueing %d running requests", why, len(self.running))
        self.trips.fail_all()
        self._next = None
        self._peers_lost += 1
        for req in reversed(list(self.running)):
            self.running.remove(req)
            req.release_resources()
            req.status = "waiting"
            self.waiting.appendleft(req)
        for req in self.waiting:
            req.reserved = req.prefetching = False
        self.cache.pending_transfers = []
        self._dropped = []
        self._refused = None
        self.cache.memory_changed()
        if why == "cache_started":
            # A new controller: greet it; prefetches start again there.
            self.cache.pending_ops = (
                [Prefetch(rid=r.rid, tokens=r.prompt_ids) for r in self.waiting] if self._prefetches() else []
            )
        else:
            # Give back whatever a racing Admit got from a controller that has already reset
            # (releasing a request the controller does not know is a no-op).
            self.cache.pending_ops = [Release(rid=r.rid) for r in self.waiting]

    def _prefetches(self) -> bool:
        return self.use_cache and self.storage

    def on_add(self, msg: AddRequest) -> None:
        if msg.rid in self.requests:
            # The front door sends a request again when it cannot tell whether a restarted
            # scheduler received it (internal rids are unique): the copy is dropped.
            self.log.debug("request %s is already here", msg.rid)
            return
        eos = set(msg.eos_token_ids)
        if self.peers.info is not None:
            eos |= set(self.peers.info.eos_token_ids)
        req = Req(msg.rid, list(msg.input_ids), msg.sampling, msg.max_tokens, frozenset(eos))
        req.siblings, req.first = list(msg.siblings), msg.first
        self.requests[req.rid] = req
        self.waiting.append(req)
        if self._prefetches():
            self.cache.queue(Prefetch(rid=req.rid, tokens=req.prompt_ids))

    def on_abort(self, rid: str, stop: bool) -> None:
        req = self.requests.get(rid)
        if req is None:
            return
        if stop:
            req.stop_requested = True
        else:
            req.abort_requested = True
        self._to_reap.add(rid)

    # ------------------------------------------------------------ the loop

    def _collect_metrics(self, m: ServiceMetrics) -> None:
        m[SCHEDULER_RUNNING].set(len(self.running))
        m[SCHEDULER_WAITING].set(len(self.waiting))
        m[SCHEDULER_MAMBA_TRACK_SLOTS].labels(strategy=self.strategy).set(sum(len(r.track_slots) for r in self.running))

    async def background(self) -> None:
        # Peers that are already up sent what we need to an earlier scheduler: ask again.
        hello = Hello(service=self.name, pid=os.getpid())
        await self.worker.send(hello)
        await self.cache.outbox.send(hello)
        if not self.peers.ready.is_set():
            self.log.info("waiting for the worker (model load and pool sizes) and the cache controller")
        await self.peers.ready.wait()
        await self.tokenizer.send(Ready(service=self.name, pid=os.getpid()))
        self.spawn(self.reporter.run(), "metrics")
        while True:
            await self.peers.ready.wait()
            # Cleared before the step, so a message arriving during it is never missed.
            self.wake.clear()
            try:
                progressed = await self.step()
            except WorkerRestarted:
                continue
            if not progressed:
                await self.wake.wait()

    async def step(self) -> bool:
        """One scheduling step; False when nothing can happen until a message arrives.

        The tokens of the previous batch (`self._outs`) go to the front door right after this
        step's RunBatch, not before it: the worker's idle time between two forwards is the
        scheduler's serial work, and encoding a few hundred TokenOuts is not needed to start the
        next forward. Every path that may wait flushes them first. At steady decode the next
        step is built and sent while this one runs, and the worker starts it the moment this
        one ends (decode_ahead.py)."""
        self._reap(self._outs)
        left_out: tuple[str, ...] | None = None
        if self._next is not None:  # sent while the previous step ran
            plan, reply, caps, _, left_out = self._next
            self._next = None
        else:
            cache_progress = False
            if not self.overlap or not self.running:
                if self.running:
                    await self._flush()
                # With nothing running the releases go first: a client that has its last token
                # finds its request's memory already given back (/flush_cache, stats).
                cache_progress = await self._cache_work(None)
            plan = pick_batch(self.running, self.cfg.scheduler.chunked_prefill_size, self.last_mode)
            if plan is not None:
                plan = await self._prepare(plan)
            if plan is None:
                await self._flush()
                if self.cache.pending_transfers or self._dropped:
                    await self._run_transfers_only()
                self._answer_unfittable_head(self._outs)
                await self._flush()
                return cache_progress or bool(self.cache.pending_ops)
            reply, caps = await self._send_batch(plan)
        await self._flush()
        early = None
        if self.overlap:
            # Prepare the next step (admissions, inserts, releases, pages) while the worker runs,
            # then build the step after this one if it is this one again, a token further, and
            # send it now: the worker starts it the moment this one ends.
            await self._cache_work(plan)
            ahead = decode_ahead.prebuild(
                plan, self.running, self.strategy, self.interval, self.page_size, self.cfg.model.max_context_len
            )
            if ahead is not None:
                early = await self._send_following(ahead, reply.key)
        done, _ = await reply.wait()
        # Both sides decide from the same tokens which requests leave a following step.
        assert left_out is None or done.error or tuple(done.left_out) == left_out, (done.left_out, left_out)
        if early is not None:
            if done.error:
                # The worker refuses the step that follows a failed one; its requests end with this one.
                self._on_batch_done(plan, done, self._outs, caps)
                later, _ = await early.reply.wait()
                self._on_batch_done(early.sent.plan, later, self._outs, early.sent.caps)
                return True
            ran = decode_ahead.ran(early.sent, done)
            if ran.plan.items:
                rids = frozenset(req.rid for req, _ in ran.plan.items)
                self._next = _Sent(ran.plan, early.reply, ran.caps, rids, ran.left_out)
            else:  # this step's tokens stop every one of them: the worker runs nothing
                later, _ = await early.reply.wait()
                assert later.error or tuple(later.left_out) == ran.left_out, (later.left_out, ran.left_out)
        self._on_batch_done(plan, done, self._outs, caps)
        return True

    async def _send_following(self, ahead: decode_ahead.Ahead, follows: int) -> _Early | None:
        """Send the prebuilt next step now, as the step following batch `follows` (still running)."""
        batch_id = self.trips.next_id()
        sent = decode_ahead.follow(ahead, batch_id, follows, self._to_reap, self.cache.pending_transfers, self._dropped)
        if sent is None:
            return None
        self.cache.pending_transfers, self._dropped = [], []
        self.last_mode = "decode"
        lost = self._peers_lost
        reply = await self.trips.call(self.worker, sent.msg, batch_id, BatchDone, sent.frames)
        _let_the_send_go()
        self.m[SCHEDULER_DECODE_STEPS_AHEAD].inc()
        if self._peers_lost != lost:
            return None  # a peer restarted while the send waited: its requests are waiting again
        return _Early(sent, reply)

    def _answer_unfittable_head(self, outs: list[TokenOut]) -> None:
        """Nothing runs, nothing is left to free, and the head was just refused: it can never fit.
        Answer instead of waiting forever."""
        head = self.waiting[0] if self.waiting else None
        refused = self._refused
        if head is None or refused is None or head.rid != refused.rid or self.running or self.cache.pending_ops:
            return
        self._finish(head, "error", outs, error=f"the request does not fit in the memory pools ({refused.reason})")

    async def _flush(self) -> None:
        if self._outs:
            outs, self._outs = self._outs, []
            await self.tokenizer.send(TokenBatch(outs=[self._token_out(o) for o in outs]))

    @staticmethod
    def _token_out(
        out: TokenOut | _NewToken | tuple[Req, int, int, FinishReason | None, CachedTokens | None],
    ) -> TokenOut:
        if isinstance(out, TokenOut):
            return out
        if not isinstance(out, _NewToken):
            out = _NewToken(*out)
        return TokenOut(
            rid=out.req.rid,
            token_ids=[out.token],
            logprobs=out.token_lp,
            finish_reason=out.reason,
            prompt_tokens=len(out.req.prompt_ids),
            completion_tokens=out.completion_tokens,
            cached=out.cached,
            top_logprobs=out.top_lp,
            prompt_logprobs=out.prompt_lp,
        )

    # ------------------------------------------------------------ cache work

    async def _cache_work(self, current: BatchPlan | None) -> bool:
        """One CacheStep: pending inserts/releases first (what they free is there for the rest),
        then (with a batch in flight) what its requests need next, then admissions."""
        ops: list[CacheOp] = self.cache.take_pending()
        if current is not None:
            ops += self.cache.predict_next(current)
        room = self.cfg.scheduler.max_running_requests - len(self.running)
        num_slots = 1 + mamba_track.track_slots_at_admission(self.strategy)
        ops += self.cache.admissions(self.waiting, room, self.requests, num_slots)
        if not ops:
            return False
        applied = await self.cache.step(ops, self.requests)
        return self._on_applied(applied)

    def _on_applied(self, applied: Applied) -> bool:
        if applied.refused is not None:
            self._refused = applied.refused
        elif applied.admitted:
            self._refused = None
        for req, res in applied.admitted:
            self._on_admitted(req, res)
        return bool(applied.admitted)

    def _on_admitted(self, req: Req, res: Admitted) -> None:
        self.waiting.remove(req)
        if req.num_retractions == 0 and req.cached is None:
            self.m[SCHEDULER_QUEUE_TIME].observe(time.monotonic() - req.arrival)
        req.status = "running"
        req.reserved = False
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
        """Pages for decode requests and lazy track slots that the overlap window did not get.
        Pending releases go first, so what they free is there before anything is refused."""
        ops = self.cache.decode_needs(plan)
        if ops:
            await self._flush()  # a round trip before the batch: the tokens do not wait for it
            self._on_applied(await self.cache.step(self.cache.take_pending() + ops, self.requests))
        elif plan.mode == "decode":
            return plan  # the common step: decode_needs found every page there (it asks otherwise)
        extra = 1 if plan.mode == "decode" else 0
        short = [q for q, _ in plan.items if len(q.pages) * self.page_size < q.computed_len + extra]
        if short:
            # Out of KV pages even after eviction: retract the newest requests (their output is
            # kept) and let the rest go on.
            for req in sorted(short, key=lambda q: q.arrival, reverse=True):
                self._retract(req)
        items = [(q, n) for q, n in plan.items if q.status == "running"]
        return BatchPlan(plan.mode, items) if items else None

    def _retract(self, req: Req) -> None:
        self.log.info("retracting %s (out of KV pages), %d generated tokens kept", req.rid, len(req.output_ids))
        self.running.remove(req)
        self.cache.queue(Release(rid=req.rid))
        self._dropped.append(req.rid)
        req.release_resources()
        req.status = "waiting"
        req.num_retractions += 1
        self.m[SCHEDULER_RETRACTIONS].inc()
        self.waiting.appendleft(req)

    async def _run_transfers_only(self) -> None:
        batch_id = self.trips.next_id()
        msg = RunBatch(
            batch_id=batch_id, mode="none", seqs=[], transfers=self.cache.pending_transfers, dropped=self._dropped
        )
        self.cache.pending_transfers, self._dropped = [], []
        await (await self.trips.call(self.worker, msg, batch_id, BatchDone)).wait()

    async def _send_batch(self, plan: BatchPlan) -> tuple[Reply[BatchDone], dict[str, list[captures.Capture]]]:
        caps: dict[str, list[captures.Capture]] = {}
        decode, interval = plan.mode == "decode", self.interval
        for req, n in plan.items:
            if decode and not req.pending_captures and (req.computed_len + 1) % interval:
                continue  # captures_for's common case, without the call (256 of them a step)
            found = captures.captures_for(req, plan.mode, n, self.strategy, interval, self.page_size)
            if found:
                caps[req.rid] = found
        batch_id = self.trips.next_id()
        msg, tensors = build_run_batch(batch_id, plan, caps, self.cache.pending_transfers, self._dropped)
        self.cache.pending_transfers, self._dropped = [], []
        self.last_mode = plan.mode
        reply = await self.trips.call(self.worker, msg, batch_id, BatchDone, tensors)
        _let_the_send_go()
        return reply, caps

    # ------------------------------------------------------------ results

    def _on_batch_done(
        self, plan: BatchPlan, done: BatchDone, outs: list[TokenOut], in_flight: dict[str, list[captures.Capture]]
    ) -> None:
        if done.error:
            for req, _ in plan.items:
                if req.status == "running":
                    self._finish(req, "error", outs, error=done.error)
            return
        now = time.monotonic()
        seq_errors = done.seq_errors
        # A request in the step already sent must not finish now: that step still writes it.
        busy = self._next.rids if self._next is not None else frozenset()
        token_lps, prompt_lps = done.token_logprobs, done.prompt_logprobs
        max_context_len = self.cfg.model.max_context_len
        next_tokens, strategy = done.next_tokens, self.strategy
        # Per running request on every step, before the next RunBatch can leave: attributes are
        # read once into locals and nothing is called on the common path but check_stop.
        for i, (req, n) in enumerate(plan.items):
            if req.status != "running":
                continue
            req.state_init = "keep"
            computed = req.computed_len = req.computed_len + n
            if in_flight:
                done_caps = in_flight.get(req.rid)
                if done_caps:
                    for op in captures.commit(req, done_caps, strategy):
                        self.cache.queue(op)
            if prompt_lps and i in prompt_lps:
                logprobs.absorb_prompt(req, prompt_lps[i])
            if req.abort_requested or req.stop_requested:
                if req.rid not in busy:  # (else it is finished after the step that writes it)
                    self._finish(req, "abort" if req.abort_requested else "stop", outs)
                elif req.stop_requested and computed >= len(req.prompt_ids) + len(req.output_ids):
                    # The step already sent computes this token: it joins the context, never sent
                    # out, so what the tree gets at the release matches the state that step leaves.
                    req.output_ids.append(next_tokens[i])
                continue  # no token after an abort or a stop string
            output = req.output_ids
            context_len = len(req.prompt_ids) + len(output)
            if computed < context_len:
                continue  # a prefill chunk that did not reach the end: no token yet
            if seq_errors and i in seq_errors:  # this sequence alone failed (sampling): its batch-mates go on
                self._finish(req, "error", outs, error=seq_errors[i])
                continue
            wants_prompt = req.sampling.prompt_logprobs is not None
            if wants_prompt and req.rid not in busy and (error := logprobs.prompt_logprobs_error(req)):
                held, wanted = len(req.prompt_logprobs), len(req.prompt_ids) - 1
                self.log.error("%s: prompt logprobs: %d of %d positions", req.rid, held, wanted)
                self._finish(req, "error", outs, error=error)
                continue
            token = next_tokens[i]
            output.append(token)
            num_output = len(output)
            token_lp, top_lp = logprobs.token_logprobs(req, done, i) if token_lps else (None, None)
            if req.first_token_time is None:
                req.first_token_time = now
                if req.siblings:
                    self.cache.memory_changed()  # its siblings may now be admitted
            reason = check_stop(req, token, num_output, context_len + 1, max_context_len)
            # The TokenOut itself is built after the next RunBatch left (`_flush`): only what
            # the next step depends on (the token, the stop check) is done before it.
            cached = None if req.cached_reported else self._cached_once(req)
            if token_lp is None and not wants_prompt:
                outs.append((req, token, num_output, reason, cached))
            else:
                prompt_lp = logprobs.first_prompt_logprobs(req) if wants_prompt else None
                outs.append(_NewToken(req, token, num_output, reason, cached, token_lp, top_lp, prompt_lp))
            if reason is not None:
                self._finish(req, reason, outs, emitted=True)

    def _cached_once(self, req: Req) -> CachedTokens | None:
        if req.cached_reported:
            return None
        req.cached_reported = True
        return req.cached or CachedTokens()

    def _reap(self, outs: list[TokenOut]) -> None:
        """Finish requests that were aborted or stopped (by stop string) since the last step."""
        rids, self._to_reap = self._to_reap, set()
        busy = self._next.rids if self._next is not None else frozenset()
        for rid in rids:
            req = self.requests.get(rid)
            if req is not None and req.status != "finished":
                if rid in busy:
                    self._to_reap.add(rid)  # in the step already sent: it leaves the one after
                    continue
                self._finish(req, "abort" if req.abort_requested else "stop", outs)

    def _finish(
        self, req: Req, reason: FinishReason, outs: list[TokenOut], emitted: bool = False, error: str = ""
    ) -> None:
        if req.status == "running":
            assert self._next is None or req.rid not in self._next.rids, f"{req.rid} finished while a step writes it"
            self.running.remove(req)
            self.cache.queue(self.cache.release_op(req, reason))
            self._dropped.append(req.rid)
        elif req.status == "waiting":
            self.waiting.remove(req)
            if self._prefetches():
                self.cache.queue(CancelPrefetch(rid=req.rid))
            if req.reserved:
                self.cache.queue(Release(rid=req.rid))  # the slots its sample 0 reserved for it
            self.cache.memory_changed()  # the head may have changed
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
        self.cache.prefetch_done.discard(req.rid)
        self.wake.set()
