"""SchedulerService: the request lifecycle loop.

Each step: flush pending cache ops and admit waiting requests (one CacheStep round trip),
pick a batch (batching.py), make sure decode requests have pages, send RunBatch to the worker,
and turn BatchDone into tokens for the tokenizer, captures into tree inserts, and finished
requests into releases. The scheduler never touches a tensor and never owns memory: it asks
the cache controller, which answers with pages, slots and copy orders.
"""

from __future__ import annotations

import asyncio
import itertools
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
    BatchDone,
    CacheOp,
    CacheStep,
    CacheStepDone,
    Extend,
    Extended,
    Inserted,
    Insert,
    Release,
    RunBatch,
    SeqPlan,
    Shutdown,
    StopRequest,
    ToScheduler,
    TokenBatch,
    TokenOut,
    Transfer,
    WorkerInfo,
)
from himamba.common.transport import Outbox
from himamba.common.types import CachedTokens
from himamba.common.wire import tensor_ref
from himamba.services.actor import Actor
from himamba.services.scheduler.batching import BatchPlan, pick_batch
from himamba.services.scheduler.request import Req
from himamba.services.scheduler.stop import check_stop


class SchedulerService(Actor[ToScheduler]):
    name = "scheduler"

    def __init__(self, cfg: Config):
        super().__init__(cfg, cfg.endpoints.scheduler_ipc, ToScheduler)  # type: ignore[arg-type]
        self.worker = Outbox(self.ctx, cfg.endpoints.worker_ipc)
        self.cache = Outbox(self.ctx, cfg.endpoints.cache_ipc)
        self.tokenizer = Outbox(self.ctx, cfg.endpoints.tokenizer_ipc)
        self.info: WorkerInfo | None = None
        self.page_size = cfg.cache.page_size
        self.use_cache = not cfg.cache.disable_radix_cache
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

    # ------------------------------------------------------------ inbox

    async def start(self) -> str:
        return "waiting for the worker" if self.info is None else ""

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
                self.info = msg
                self._info_ready.set()
                self.log.info("worker ready: vocab %d, %d pages, %d state slots", msg.vocab_size, msg.num_pages, msg.num_state_slots)
            case Shutdown():
                pass
        self.wake.set()

    def on_add(self, msg: AddRequest) -> None:
        if msg.rid in self.requests:
            self._emit_now(TokenOut(rid=msg.rid, token_ids=[], finish_reason="error", error=f"duplicate request id {msg.rid}"))
            return
        eos = set(msg.eos_token_ids)
        if self.info is not None:
            eos |= set(self.info.eos_token_ids)
        req = Req(msg.rid, list(msg.input_ids), msg.sampling, msg.max_tokens, frozenset(eos))
        self.requests[req.rid] = req
        self.waiting.append(req)

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

    async def _call(self, outbox: Outbox, msg: Any, key: int, tensors: list[torch.Tensor] = ()) -> tuple[Any, list[Any]]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._replies[key] = fut
        await outbox.send(msg, tensors)
        return await fut

    async def cache_step(self, ops: list[CacheOp]) -> list[Any]:
        step_id = next(self._ids)
        reply, _ = await self._call(self.cache, CacheStep(step_id=step_id, ops=ops), step_id)
        self.pending_transfers.extend(reply.transfers)
        return list(reply.results)

    # ------------------------------------------------------------ the loop

    async def background(self) -> None:
        await self._info_ready.wait()
        while True:
            progressed = await self.step()
            if not progressed:
                self.wake.clear()
                await self.wake.wait()

    async def step(self) -> bool:
        outs: list[TokenOut] = []
        self._reap(outs)
        admits = self._plan_admissions()
        ops = self.pending_ops + admits
        self.pending_ops = []
        admitted_any = False
        if ops:
            results = await self.cache_step(ops)
            admitted_any = self._apply_cache_results(results)
        plan = pick_batch(self.running, self.cfg.scheduler.chunked_prefill_size, self.last_mode)
        if plan is not None and plan.mode == "decode":
            plan = await self._ensure_decode_pages(plan, outs)
        if plan is None or not plan.items:
            if self.pending_transfers:
                await self._run_transfers_only()
            await self._flush(outs)
            return bool(ops) and (admitted_any or bool(self.pending_ops))
        await self._run(plan, outs)
        await self._flush(outs)
        return True

    async def _flush(self, outs: list[TokenOut]) -> None:
        if outs:
            await self.tokenizer.send(TokenBatch(outs=outs))

    def _reap(self, outs: list[TokenOut]) -> None:
        """Finish requests that were aborted or stopped (by stop string) since the last step."""
        for req in list(self.waiting):
            if req.abort_requested or req.stop_requested:
                self.waiting.remove(req)
                self._finish(req, "abort" if req.abort_requested else "stop", outs, insert=False)
        for req in list(self.running):
            if req.abort_requested or req.stop_requested:
                self._finish(req, "abort" if req.abort_requested else "stop", outs, insert=req.stop_requested)

    def _plan_admissions(self) -> list[CacheOp]:
        ops: list[CacheOp] = []
        room = self.cfg.scheduler.max_running_requests - len(self.running)
        for req in itertools.islice(self.waiting, max(room, 0)):
            ops.append(Admit(rid=req.rid, tokens=req.context, num_slots=1, use_cache=self.use_cache))
        return ops

    def _apply_cache_results(self, results: list[Any]) -> bool:
        admitted_any = False
        blocked = False
        for res in results:
            if isinstance(res, Admitted):
                req = self.requests.get(res.rid)
                if req is None or req.status != "waiting":
                    continue
                if not res.ok or blocked:
                    # FCFS: a request that does not fit blocks the ones behind it this step.
                    blocked = True
                    if res.ok:
                        self.pending_ops.append(Release(rid=res.rid))
                    continue
                self._on_admitted(req, res)
                admitted_any = True
            elif isinstance(res, Inserted):
                req = self.requests.get(res.rid)
                if req is not None and req.status == "running" and res.pages:
                    req.pages[: len(res.pages)] = res.pages
        return admitted_any

    def _on_admitted(self, req: Req, res: Admitted) -> None:
        self.waiting.remove(req)
        req.status = "running"
        req.pages = list(res.pages)
        req.slots = list(res.slots)
        req.computed_len = res.cached_len
        req.last_state_len = res.cached_len
        if res.state_src is not None and res.cached_len > 0:
            req.state_init, req.state_src = "copy", res.state_src
        else:
            req.state_init = "zero"
        req.pending_captures = [tuple(c) for c in res.captures]  # type: ignore[misc]
        if req.cached is None:
            req.cached = res.cached
        self.running.append(req)

    async def _ensure_decode_pages(self, plan: BatchPlan, outs: list[TokenOut]) -> BatchPlan | None:
        ops: list[CacheOp] = []
        for req, _ in plan.items:
            need = req.computed_len + 1
            if len(req.pages) * self.page_size < need:
                ops.append(Extend(rid=req.rid, total_len=need))
        if not ops:
            return plan
        results = await self.cache_step(ops)
        failed = {r.rid for r in results if isinstance(r, Extended) and not r.ok}
        for r in results:
            if isinstance(r, Extended) and r.ok:
                self.requests[r.rid].pages.extend(r.new_pages)
        if failed:
            # Out of pages: retract the newest requests (their output is kept) until it fits.
            for req in sorted((q for q, _ in plan.items if q.rid in failed), key=lambda q: q.arrival, reverse=True):
                self._retract(req)
        items = [(q, n) for q, n in plan.items if q.status == "running"]
        return BatchPlan(plan.mode, items) if items else None

    def _retract(self, req: Req) -> None:
        self.log.info("retracting %s (out of KV pages), %d tokens kept", req.rid, len(req.output_ids))
        self.running.remove(req)
        self.pending_ops.append(Release(rid=req.rid))
        req.release_resources()
        req.status = "waiting"
        req.num_retractions += 1
        self.waiting.appendleft(req)

    async def _run_transfers_only(self) -> None:
        batch_id = next(self._ids)
        msg = RunBatch(batch_id=batch_id, mode="none", seqs=[], transfers=self.pending_transfers)
        self.pending_transfers = []
        await self._call(self.worker, msg, batch_id)

    async def _run(self, plan: BatchPlan, outs: list[TokenOut]) -> None:
        seqs: list[SeqPlan] = []
        ids: list[int] = []
        pages: list[int] = []
        for req, n in plan.items:
            start = req.computed_len
            ctx = req.context
            ids.extend(ctx[start : start + n])
            npages = -(-(start + n) // self.page_size)
            pages.extend(req.pages[:npages])
            captures = [(pos - start, slot) for pos, slot in req.pending_captures if start < pos <= start + n]
            seqs.append(
                SeqPlan(
                    rid=req.rid,
                    prefix_len=start,
                    new_len=n,
                    num_pages=npages,
                    state_slot=req.working_slot,
                    state_init=req.state_init,
                    state_src=req.state_src,
                    captures=captures,
                    sampling=req.sampling,
                    step=len(req.output_ids),
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
        done, _ = await self._call(self.worker, msg, batch_id, [ids_t, pages_t])
        self._on_batch_done(plan, done, outs)

    def _on_batch_done(self, plan: BatchPlan, done: BatchDone, outs: list[TokenOut]) -> None:
        if done.error:
            for req, _ in plan.items:
                if req.status == "running":
                    self._finish(req, "error", outs, insert=False, error=done.error)
            return
        now = time.monotonic()
        for i, (req, n) in enumerate(plan.items):
            if req.status != "running":
                continue
            req.state_init = "keep"
            start = req.computed_len
            req.computed_len += n
            for pos, slot in [c for c in req.pending_captures if start < c[0] <= req.computed_len]:
                # The forward that wrote this state has completed: now the tree may have it.
                req.pending_captures.remove((pos, slot))
                req.slots.remove(slot)
                self.pending_ops.append(Insert(rid=req.rid, tokens=req.context[:pos], slot=slot))
                req.last_state_len = max(req.last_state_len, pos)
            if req.abort_requested:
                self._finish(req, "abort", outs, insert=False)
                continue
            if req.computed_len < req.context_len:
                continue  # a prefill chunk that did not reach the end: no token yet
            req.output_ids.append(done.next_tokens[i])
            if done.logprobs is not None:
                req.logprobs.append(done.logprobs[i])
            if req.first_token_time is None:
                req.first_token_time = now
            reason = check_stop(req, self.cfg.model.max_context_len)
            out = TokenOut(
                rid=req.rid,
                token_ids=[done.next_tokens[i]],
                logprobs=[done.logprobs[i]] if done.logprobs is not None else None,
                finish_reason=reason,
                prompt_tokens=len(req.prompt_ids),
                completion_tokens=len(req.output_ids),
                cached=self._cached_once(req),
            )
            outs.append(out)
            if reason is not None:
                self._finish(req, reason, outs, insert=True, emitted=True)

    def _cached_once(self, req: Req) -> CachedTokens | None:
        if req.cached_reported:
            return None
        req.cached_reported = True
        return req.cached or CachedTokens()

    def _finish(self, req: Req, reason: str, outs: list[TokenOut], insert: bool, emitted: bool = False, error: str = "") -> None:
        was_running = req.status == "running"
        req.status = "finished"
        req.finish_reason = reason  # type: ignore[assignment]
        if was_running:
            self.running.remove(req)
            tokens: list[int] = []
            slot = None
            if insert and self.use_cache:
                # Give the tree every whole page of computed KV; the working state goes with it
                # when it sits exactly on a page boundary past the last state already given.
                done_len = req.computed_len
                tokens = req.context[: done_len - done_len % self.page_size]
                if done_len % self.page_size == 0 and done_len > req.last_state_len and req.slots:
                    slot = req.working_slot
            self.pending_ops.append(Release(rid=req.rid, tokens=tokens, slot=slot))
        if not emitted:
            outs.append(
                TokenOut(
                    rid=req.rid,
                    token_ids=[],
                    finish_reason=reason,  # type: ignore[arg-type]
                    prompt_tokens=len(req.prompt_ids),
                    completion_tokens=len(req.output_ids),
                    cached=self._cached_once(req),
                    error=error,
                )
            )
        del self.requests[req.rid]
        self.wake.set()
