"""WorkerService: owns the model and every device tensor; runs what the scheduler orders.

Per RunBatch: execute its copy orders (device<->host), initialise state slots, run the forward,
sample, answer BatchDone. Orders run strictly in arrival order, which is what lets the cache
controller reuse a page right after ordering it copied elsewhere.

Under tensor parallelism this is rank 0 of N (or, built by rank_follower.run_follower, a follower): each
rank holds its shard of the model, of every page and of every state slot (same ids on every rank);
rank 0 hands the followers each message that changes device state (tp_ranks.Fanout), samples from the
gathered logits alone and answers for the group.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from himamba.common.config import Config
from himamba.common.grammar import spec_key
from himamba.common.messages import (
    BatchDone,
    GrammarReady,
    Hello,
    PrepareGrammar,
    Ready,
    ResetState,
    RunBatch,
    Shutdown,
    ToWorker,
    TransfersDone,
    WorkerInfo,
)
from himamba.common.metrics import WORKER_STEP_TIME, WORKER_STEP_TOKENS, WORKER_TENSOR_PARALLEL_RANKS
from himamba.common.metrics_report import MetricsReporter
from himamba.common.openmp_wait import describe_openmp_wait
from himamba.common.runtime_dir import instance_dir
from himamba.common.transport import Outbox
from himamba.common.wire import WireError, tensor_ref
from himamba.kernels.dispatch import describe_cpu_kernels
from himamba.services.actor import Actor
from himamba.services.worker.decode_graphs import DecodeGraphs, describe_capture, scratch_rows
from himamba.services.worker.follow_on import LastSampled, resolve, sampled
from himamba.services.worker.grammar_masks import GrammarCompiler
from himamba.services.worker.heap_reuse import reuse_heap
from himamba.services.worker.host_transfer import CopyFaults, HostTransfer, host_layout
from himamba.services.worker.loader import load_model
from himamba.services.worker.logit_bias import LogitBias
from himamba.services.worker.logprobs import plan_logit_rows, prompt_logprobs, sampled_logprobs
from himamba.services.worker.memory import plan_pools
from himamba.services.worker.page_tables import PageTables
from himamba.services.worker.pools import KVPool, StatePool
from himamba.services.worker.runner import build_forward_batch, slots_to_zero
from himamba.services.worker.sampler import sample
from himamba.services.worker.step_threads import Choice, StepThreads
from himamba.services.worker.tensor_parallel import close_group, init_group, threads_per_rank
from himamba.services.worker.tp_ranks import Fanout, ranks_env
from himamba.services.worker.warmup import warm_up_prefill

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_eos_token_ids(model_dir: Path) -> list[int]:
    """EOS ids from generation_config.json, else config.json."""
    for name in ("generation_config.json", "config.json"):
        p = model_dir / name
        if p.exists():
            eos = json.loads(p.read_text()).get("eos_token_id")
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
    return []


def _random_weights(model_dir: Path) -> bool:
    """True for checkpoints made by `himamba make-model` (they carry a himamba.json marker)."""
    marker = model_dir / "himamba.json"
    return marker.exists() and bool(json.loads(marker.read_text()).get("random_weights"))


class WorkerService(Actor[ToWorker]):
    name = "worker"

    def __init__(self, cfg: Config, rank: int = 0):
        super().__init__(cfg, cfg.endpoints.worker_ipc, ToWorker)  # type: ignore[arg-type]
        self.tp_rank, self.tp_size = rank, cfg.model.tensor_parallel_size
        self.fanout: Fanout | None = None  # set once the group is joined (tensor parallelism only)
        cuda = cfg.model.device == "cuda"
        self.device = torch.device(f"cuda:{rank}" if cuda and self.tp_size > 1 else cfg.model.device)
        self.scheduler = Outbox(self.ctx, cfg.endpoints.scheduler_ipc)
        self.cache = Outbox(self.ctx, cfg.endpoints.cache_ipc)
        self.tokenizer = Outbox(self.ctx, cfg.endpoints.tokenizer_ipc)
        self.reporter = MetricsReporter("worker", self.tokenizer, cfg.metrics.report_interval_s)
        self.m = self.reporter.metrics
        self.m[WORKER_TENSOR_PARALLEL_RANKS].set(self.tp_size)

    async def start(self) -> str:
        cfg = self.cfg
        if cfg.model.torch_threads:
            torch.set_num_threads(cfg.model.torch_threads)
        elif self.tp_size > 1 and self.device.type == "cpu":  # the ranks share the cores
            torch.set_num_threads(threads_per_rank(self.tp_size))
        if self.tp_size > 1:
            if self.device.type == "cuda":
                if torch.cuda.device_count() < self.tp_size:
                    raise RuntimeError(
                        f"tensor parallelism: --tensor-parallel-size {self.tp_size} needs {self.tp_size} GPUs "
                        f"(one per rank); this machine has {torch.cuda.device_count()}"
                    )
                torch.cuda.set_device(self.device)
            _, init = ranks_env()
            if not init:
                raise RuntimeError("tensor parallelism: no rendezvous address (start the server with himamba serve)")
            # In a thread: rank 0's loop still takes a stop signal while the ranks meet.
            await asyncio.to_thread(init_group, self.tp_rank, self.tp_size, init, self.device)
            self.fanout = Fanout(self.tp_rank)
        if cfg.model.heap_reuse:
            heap = reuse_heap()
            self.log.info("heap reuse: %s", heap.reason)
        if self.device.type == "cpu":
            self.log.info("OpenMP idle threads: %s", describe_openmp_wait(os.environ))
            # Built (or loaded) here, before the first request, which would otherwise wait for the compiler.
            self.log.info("CPU kernels: %s", describe_cpu_kernels())
        use_adaptive = cfg.model.adaptive_threads and self.device.type == "cpu"
        self.threads = StepThreads(torch.get_num_threads(), on_choice=self._log_thread_choice) if use_adaptive else None
        self._last: LastSampled | None = None  # what the last step sampled: a following step's inputs
        model_dir = Path(cfg.model.model)
        t0 = time.perf_counter()
        self.model = load_model(model_dir, device=self.device, dtype=_DTYPES[cfg.model.dtype])
        kv_spec, state_spec = self.model.kv_spec(), self.model.state_spec()
        plan = plan_pools(cfg, kv_spec, state_spec, self.device)
        if self.fanout is not None:
            plan = self.fanout.agree_plan(plan)
        self.page_size = cfg.cache.page_size
        # CUDA graphs pad decode batches with a scratch page and state slot past the controller's pools.
        # No CUDA graphs under tensor parallelism yet: capturing NCCL collectives is not verified.
        graphs = self.device.type == "cuda" and not cfg.model.disable_cuda_graph and self.tp_size == 1
        self.kv = KVPool(kv_spec, plan.num_pages + graphs, self.page_size, self.device)
        self.state = StatePool(state_spec, plan.num_state_slots + graphs, self.device)
        self.num_state_slots = plan.num_state_slots  # the controller's: slot ids past it are the worker's
        layout = host_layout(self.kv, self.state, plan.num_host_pages, plan.num_host_state_slots, self.tp_size)
        d = cfg.debug
        faults = CopyFaults(
            d.transfer_fail_at, d.batch_fail_at_transfer, d.worker_exit_at_transfer, d.transfer_direction,
            exit_marker=instance_dir(cfg) / "debug-worker-exit.fired" if d.worker_exit_at_transfer else None,
        )
        if self.fanout is not None and self.tp_rank:  # rank 0's segments, created before it shares the layout
            layout = self.fanout.share(None)
        self.host = HostTransfer(self.kv, self.state, layout, self.device, faults, rank=self.tp_rank)
        if self.fanout is not None and self.tp_rank == 0:
            self.fanout.share(layout)
        self.log.info("%s", self.host.describe())
        tokenizer_json = Path(cfg.model.tokenizer or cfg.model.model) / "tokenizer.json"
        self.grammars = GrammarCompiler(tokenizer_json, self.model.vocab_size, read_eos_token_ids(model_dir))
        self.logit_bias = LogitBias(cfg.scheduler.max_running_requests, self.device)
        self._announcing: set[asyncio.Task[None]] = set()  # GrammarReady replies waiting for their build
        self.tables = PageTables(self.page_size, plan.num_pages, self.model.vocab_size, self.device, self.grammars)
        self.info = WorkerInfo(
            vocab_size=self.model.vocab_size,
            eos_token_ids=read_eos_token_ids(model_dir),
            num_attention_layers=kv_spec.num_layers,
            num_recurrent_layers=state_spec.num_layers,
            # The whole model's bytes (every rank's shard): what the controller's pools hold per page and slot.
            kv_bytes_per_token=kv_spec.bytes_per_token() * self.tp_size,
            state_bytes_per_slot=state_spec.bytes_per_slot() * self.tp_size,
            num_pages=plan.num_pages,
            num_state_slots=plan.num_state_slots,
            num_host_pages=plan.num_host_pages,
            num_host_state_slots=plan.num_host_state_slots,
            model_name=cfg.model.served_model_name or model_dir.name,
            random_weights=_random_weights(model_dir),
            host_layout=layout,
            pid=os.getpid(),
        )
        self.graphs: DecodeGraphs | None = None
        if graphs:
            scratch = scratch_rows(plan.num_pages, self.page_size, plan.num_state_slots)
            seconds = warm_up_prefill(self.model, self.kv, self.state, scratch, self.page_size, self.device)
            self.log.info("warm-up: prefill kernels compiled in %.1fs", seconds)
            self.graphs = DecodeGraphs(
                self.model, self.kv, self.state, scratch,
                max_batch=min(cfg.model.cuda_graph_max_bs, cfg.scheduler.max_running_requests),
                max_len=cfg.model.max_context_len + 1, device=self.device,
            )  # fmt: skip
            try:
                self.log.info("%s", describe_capture(self.graphs.capture(lambda line: self.log.info("%s", line))))
            except Exception as e:  # noqa: BLE001 - a forward that cannot be captured still serves, eagerly
                self.graphs = None
                torch.cuda.synchronize()
                self.log.warning("CUDA graphs: capture failed (%s: %s); decode runs eagerly", type(e).__name__, e)
        for peer in (self.scheduler, self.cache, self.tokenizer):
            await peer.send(self.info)
        if self.info.random_weights:
            self.log.warning("serving %s: RANDOM WEIGHTS (a demo checkpoint), its text is noise", model_dir)
        tp = f"; tensor parallel rank {self.tp_rank} of {self.tp_size}" if self.tp_size > 1 else ""
        return (
            f"model {model_dir.name} loaded in {time.perf_counter() - t0:.1f}s{tp}; "
            f"KV {plan.num_pages} pages x {self.page_size} tokens "
            f"({plan.num_pages * self.page_size * kv_spec.bytes_per_token() / 2**20:.1f} MiB), "
            f"{plan.num_state_slots} state slots ({plan.num_state_slots * state_spec.bytes_per_slot() / 2**20:.1f} MiB); "
            f"host {plan.num_host_pages} pages, {plan.num_host_state_slots} state slots"
        )

    async def background(self) -> None:
        await self.tokenizer.send(Ready(service=self.name, pid=os.getpid()))
        await self.reporter.run()

    async def _announce_grammar(self, key: bytes, built: asyncio.Future[Any]) -> None:
        """Tell the front door the grammar is built (it queues the request then)."""
        try:
            await built
            error = ""
        except (ValueError, RuntimeError, OSError, TypeError) as e:
            error = f"grammar: {e}"
        await self.tokenizer.send(GrammarReady(key=key, error=error))

    async def handle(self, msg: ToWorker, frames: list[Any]) -> None:
        if self.fanout is not None and self.tp_rank == 0 and _changes_ranks(msg):
            self.fanout.send(msg, frames)  # the followers run it too, in the same order
        match msg:
            case RunBatch():
                await self.on_run_batch(msg, frames)
            case ResetState(slots=slots):
                self.state.zero(torch.tensor(slots, dtype=torch.int64, device=self.device))
                self.host.unwritten.slots_zeroed(slots)
            case PrepareGrammar(grammar=grammar, lowered=lowered):
                built = asyncio.wrap_future(self.grammars.prepare(grammar, lowered))
                task = asyncio.create_task(self._announce_grammar(spec_key(grammar), built))
                self._announcing.add(task)
                task.add_done_callback(self._announcing.discard)
            case Hello(service=service):
                # A restarted peer missed our WorkerInfo. Answered in inbox order, so it also
                # tells the peer that every batch (and copy) sent before its Hello has run.
                peer = {"scheduler": self.scheduler, "cache": self.cache, "tokenizer": self.tokenizer}.get(service)
                if peer is None:
                    self.log.warning("hello from unknown service %r", service)
                else:
                    if service == "scheduler":
                        self.tables.clear()  # a new scheduler: its sequences start with fresh tables
                        self._last = None  # and none of its steps follows ours
                    await peer.send(self.info)
            case Shutdown():
                pass

    async def on_run_batch(self, msg: RunBatch, frames: list[Any]) -> None:
        t0 = time.perf_counter()
        self.tables.drop(msg.dropped)
        # Every copy order ends here, done or failed, whatever happens to the forward; the cache
        # hears first, so it has rolled back failed copies before the scheduler's next step.
        copies = self.host.run_orders(msg.transfers)
        if self.fanout is not None:  # an order is done when every rank did it
            copies = self.fanout.merge_copies(copies)
            self.host.unwritten.agree(msg.transfers, copies.failed)
        if copies.done or copies.failed:
            await self.cache.send(TransfersDone(op_ids=copies.done, failed=copies.failed))
        try:
            if copies.failed:
                self.log.error("batch %d: %d copy orders failed: %s", msg.batch_id, len(copies.failed), copies.error)
            if self.host.faults.fail_batch:
                self.host.faults.fail_batch = False
                raise RuntimeError("batch failed (debug.batch_fail_at_transfer)")
            left_out: list[str] = []
            if msg.follows >= 0:  # its tokens are the last step's (follow_on.py)
                msg, frames, left_out = resolve(msg, frames, self._last)
            if msg.mode == "none" or not msg.seqs:
                result = BatchDone(batch_id=msg.batch_id, next_tokens=[])
                tensors: list[torch.Tensor] = []
            else:
                result, tensors = self.forward(msg, frames)
        except (WireError, ValueError, IndexError, RuntimeError) as e:
            self._last = None  # a step that follows this one fails too
            if self.fanout is not None:
                self._last = self.fanout.share(None)  # the followers take rank 0's word for it
            self.log.error("batch %d failed: %s", msg.batch_id, e)
            # The client sees no exception text (it may hold internals); the log has it.
            error = f"the forward failed ({type(e).__name__}; see the worker log)"
            await self.scheduler.send(BatchDone(batch_id=msg.batch_id, next_tokens=[], error=error))
            return
        result = BatchDone(
            batch_id=result.batch_id,
            next_tokens=result.next_tokens,
            token_logprobs=result.token_logprobs,
            prompt_logprobs=result.prompt_logprobs,
            forward_s=time.perf_counter() - t0,
            logits=result.logits,
            seq_errors=result.seq_errors,
            left_out=left_out,
        )
        self._last = sampled(msg, result)
        if self.fanout is not None:  # only rank 0 sampled: a following step reads its tokens on every rank
            self._last = self.fanout.share(self._last)
        await self.scheduler.send(result, tensors)
        self.m[WORKER_STEP_TIME].labels(mode=msg.mode).observe(time.perf_counter() - t0)
        self.m[WORKER_STEP_TOKENS].labels(mode=msg.mode).inc(sum(q.new_len for q in msg.seqs))

    async def stop(self) -> None:
        if self.fanout is not None and self.tp_rank == 0:
            try:
                self.fanout.send(Shutdown(reason="rank 0 stops"), [])
            except Exception as e:  # noqa: BLE001 - a follower is gone already: the group is broken
                self.log.warning("tensor parallel group: could not stop the other ranks: %s", e)
            close_group()
        if hasattr(self, "host"):
            self.host.close()
        if hasattr(self, "grammars"):
            self.grammars.close()

    def forward(self, msg: RunBatch, frames: list[Any]) -> tuple[BatchDone, list[torch.Tensor]]:
        """One step on the thread count `StepThreads` picks for its size (on the CPU)."""
        if self.threads is None:
            return self._forward(msg, frames, None)
        with self.threads.step(sum(s.new_len for s in msg.seqs)) as plan:
            return self._forward(msg, frames, plan.head_threads)

    def _log_thread_choice(self, choice: Choice) -> None:
        # A size class's first pick is news; later flips follow the load.
        self.log.log(logging.INFO if choice.first else logging.DEBUG, "%s", choice.describe())

    @torch.inference_mode()
    def _forward(
        self, msg: RunBatch, frames: list[Any], head_threads: int | None
    ) -> tuple[BatchDone, list[torch.Tensor]]:
        batch, states = build_forward_batch(msg, frames, self.tables, self.num_state_slots, self.device)
        batch.head_threads = head_threads
        self.host.unwritten.check_batch(msg.seqs, states, self.page_size)  # before anything is written
        zero = slots_to_zero(msg.mode, msg.seqs)
        if zero:
            self.state.zero(torch.tensor(zero, dtype=torch.int64, device=self.device))
        copies = [(s.state_src, s.state_slot) for s in msg.seqs if s.state_init == "copy"]
        if copies:
            src = torch.tensor([c[0] for c in copies], dtype=torch.int64, device=self.device)
            dst = torch.tensor([c[1] for c in copies], dtype=torch.int64, device=self.device)
            self.state.copy(src, dst)
        rows = plan_logit_rows(msg.mode, msg.seqs, states)
        if rows is not None:  # some sequence wants prompt logprobs: the model returns those rows too
            batch.logit_rows = rows.rows.to(self.device)
        logits = self.graphs.run(batch) if self.graphs is not None else None
        if logits is None:  # no graph for this batch (or none at all): eager
            logits = self.model.forward(batch, self.kv, self.state)
        prompt_lps = {}
        if rows is not None:
            prompt_lps = prompt_logprobs(logits, rows, batch.input_ids, states)
            logits = logits.index_select(0, rows.last.to(logits.device))
        self.host.unwritten.batch_ran(msg.seqs, states, self.page_size)
        final = [(s.state_slot, slot) for s in msg.seqs for off, slot in s.captures if off == s.new_len]
        if final:
            src = torch.tensor([f[0] for f in final], dtype=torch.int64, device=self.device)
            dst = torch.tensor([f[1] for f in final], dtype=torch.int64, device=self.device)
            self.state.copy(src, dst)
        if self.tp_rank:  # a follower: its pools are written; sampling is rank 0's
            return BatchDone(batch_id=msg.batch_id, next_tokens=[]), []
        params = [q.sampling for q in states]
        masks = self.grammars.masks([q.grammar for q in states], logits.shape[-1])
        bias = self.logit_bias.load(params)
        sampled = sample(logits, params, [s.step for s in msg.seqs], [q.penalties for q in states], masks, bias)
        tensors: list[torch.Tensor] = []
        ref = None
        if msg.return_logits:
            tensors.append(logits.float().cpu())
            ref = tensor_ref(tensors[0], 0)
        if sampled.errors:
            self.log.error("batch %d: sampling failed for %d sequence(s): %s", msg.batch_id, len(sampled.errors), sampled.errors)
        done = BatchDone(
            batch_id=msg.batch_id,
            next_tokens=sampled.tokens,
            token_logprobs=sampled_logprobs(logits, params, sampled.tokens, sampled.errors),
            prompt_logprobs=prompt_lps,
            logits=ref,
            seq_errors=sampled.errors,
        )
        return done, tensors


def _changes_ranks(msg: ToWorker) -> bool:
    """Whether the followers must run `msg` too: it touches device state or the page tables."""
    return isinstance(msg, (RunBatch, ResetState)) or (isinstance(msg, Hello) and msg.service == "scheduler")
