"""Structured outputs in the worker: a grammar matcher per constrained sequence, and its mask
applied to that sequence's logits row before sampling.

Grammars are built off the step loop: the front door sends `PrepareGrammar` as it accepts a
request, with the grammar already lowered to llguidance's text by its check, and a one-thread pool
builds each (kind, spec) once into a template matcher (an LRU); a sequence's matcher is a copy of
its template (`deep_copy`, microseconds). The build from lowered text is the library's native
compile, which releases the GIL: the step thread runs beside it. Converting a spec (JSON parsing,
schema walks: Python, holding the GIL for tens of milliseconds on a large one) happens here only for
a grammar that came without its lowered text (a request whose step arrives before any PrepareGrammar:
a restarted worker), still in the pool's thread. Only if a request's first step comes before its
build finished does that step wait for it, and `step_waits` counts it.

A matcher's state is a function of the sequence's output tokens, and the worker is fed every
token of a sequence's context in order (prompt chunks, then each sampled token as the next
step's input), so it consumes each output token as it is fed. A sequence whose page table is
reset (retraction, a restarted scheduler or worker) gets the context before its first new token
as `history`, and its matcher is rebuilt from the outputs in it: nothing depends on earlier steps.

Unconstrained sequences pay nothing: a batch without a constrained sequence skips all of this,
and the masks of one with some are computed and applied for those rows only.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import NamedTuple

import llguidance
import torch

from himamba.common.grammar import (
    GRAMMAR_DEAD_END,
    grammar_thread_pool,
    make_tokenizer,
    matcher_from_text,
    new_matcher,
    spec_key,
)
from himamba.common.types import GrammarSpec

log = logging.getLogger("himamba.worker")
TEMPLATE_CACHE_SIZE = 64  # grammars kept built (a template is the grammar plus its lexer cache)
PARALLEL_MIN_ROWS = 8  # see GrammarCompiler.parallel_min_rows
PARALLEL_MIN_CORES = 8


class GrammarCompiler:
    """Builds template matchers in a background thread, once per (kind, spec) while cached."""

    def __init__(
        self, tokenizer_json: Path, vocab_size: int, eos_token_ids: list[int], size: int = TEMPLATE_CACHE_SIZE
    ):
        self.tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.size = size
        self._pool = grammar_thread_pool("grammar")
        self._tokenizer: Future[llguidance.LLTokenizer] | None = None
        self._templates: OrderedDict[bytes, Future[llguidance.LLMatcher]] = OrderedDict()
        self._executor: llguidance.LLExecutor | None = None
        # Masks of this many rows or more are computed by llguidance's thread pool. Its threads
        # spin between batches and steal the model's cores on small machines: only with cores to spare.
        self.parallel_min_rows = PARALLEL_MIN_ROWS if (os.cpu_count() or 1) >= PARALLEL_MIN_CORES else 0
        self.builds = 0  # grammars built (tests and logs)
        self.conversions = 0  # of those, built from the spec (no lowered text came with it)
        self.step_waits = 0  # steps that waited for a build (none, when the front door gates requests)

    def prepare(self, spec: GrammarSpec, lowered: str = "") -> Future[llguidance.LLMatcher]:
        """The template of `spec`, built (or being built) in the background; from `lowered` (the
        front door's conversion of it) when given."""
        key = spec_key(spec)
        got = self._templates.get(key)
        if got is not None:
            self._templates.move_to_end(key)
            return got
        if self._tokenizer is None:
            self._tokenizer = self._pool.submit(self._load_tokenizer)
        fut = self._pool.submit(self._build, spec, lowered)
        self._templates[key] = fut
        while len(self._templates) > self.size:
            self._templates.popitem(last=False)  # a sequence holding it keeps its own reference
        return fut

    def _load_tokenizer(self) -> llguidance.LLTokenizer:
        try:
            text = self.tokenizer_json.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"structured outputs need the model's tokenizer.json: {e.strerror}") from None
        return make_tokenizer(text, self.vocab_size, self.eos_token_ids)

    def _build(self, spec: GrammarSpec, lowered: str) -> llguidance.LLMatcher:
        assert self._tokenizer is not None
        if lowered:
            matcher = matcher_from_text(lowered, self._tokenizer.result())
        else:
            self.conversions += 1
            log.info("a %s grammar came without its lowered text: converted in the worker", spec.kind)
            matcher = new_matcher(spec, self._tokenizer.result())
        matcher.compute_bitmask()  # warms the lexer for the first state, here rather than in a step
        self.builds += 1
        return matcher

    def state(self, spec: GrammarSpec, num_prompt: int) -> GrammarState:
        return GrammarState(self.prepare(spec), num_prompt, self)

    def masks(self, states: Sequence[GrammarState | None], vocab_size: int) -> GrammarMasks | None:
        """The masks of a batch's constrained rows (None when it has none)."""
        rows = [i for i, g in enumerate(states) if g is not None]
        if not rows:
            return None
        words = (vocab_size + 31) // 32
        bitmask = torch.zeros((len(rows), words), dtype=torch.int32)  # a row left 0 allows nothing
        errors: dict[int, str] = {}
        work: list[tuple[llguidance.LLMatcher, int]] = []
        for k, i in enumerate(rows):
            g = states[i]
            assert g is not None
            matcher = g.matcher_now()
            if matcher is None:
                errors[i] = g.error or "grammar: no matcher"
            else:
                work.append((matcher, k))
        if work:
            if self.parallel_min_rows and len(work) >= self.parallel_min_rows:
                if self._executor is None:
                    self._executor = llguidance.LLExecutor()
                self._executor.unsafe_compute_mask_ptr(work, bitmask.data_ptr(), words * 4, len(rows))
            else:
                base = bitmask.data_ptr()
                for matcher, k in work:
                    matcher.unsafe_compute_mask_ptr(base + k * words * 4, words * 4)
            empty = (bitmask == 0).all(dim=1).tolist()
            for matcher, k in work:
                if matcher.is_error():  # a mask the grammar could not compute: the row fails alone
                    errors[rows[k]] = _dead_end(matcher.get_error())
                elif empty[k]:  # e.g. a finished grammar on a model without an end-of-sequence token
                    errors[rows[k]] = f"{GRAMMAR_DEAD_END} (no token of the vocabulary is allowed here)"
        return GrammarMasks(rows, bitmask, errors)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarState:
    """One sequence's matcher, fed the sequence's output tokens in order."""

    def __init__(
        self, template: Future[llguidance.LLMatcher], num_prompt: int, compiler: GrammarCompiler | None = None
    ):
        self._template = template
        self._compiler = compiler  # counts a step's wait for the build
        self.num_prompt = num_prompt
        self.seen = 0  # output tokens fed so far (consumed, or pending until the matcher exists)
        self.matcher: llguidance.LLMatcher | None = None
        self.pending: list[int] = []
        self.error: str | None = None

    def feed(self, start: int, tokens: torch.Tensor) -> None:
        """Context tokens at positions [start, start + len(tokens)) (a CPU tensor); those of the
        output not fed before are consumed."""
        first = self.num_prompt + self.seen  # the first output position not fed yet
        end = start + tokens.numel()
        if end <= first or self.error is not None:
            return
        if start > first:
            self.error = "grammar: the worker missed output tokens (no history at reset)"
            return
        new = tokens[first - start :].tolist()
        if len(new) > 1:  # outputs fed again: a recomputed sequence (retraction, restart)
            log.info("grammar matcher fed %d output tokens at once (a recomputed sequence)", len(new))
        self.seen += len(new)
        self.pending.extend(new)
        if self.matcher is not None:
            self._consume()

    def matcher_now(self) -> llguidance.LLMatcher | None:
        """The matcher, up to date with every token fed; waits for its grammar's build if needed.
        None when the grammar failed (`error` says why)."""
        if self.matcher is None and self.error is None:
            if not self._template.done():  # the build started late (a restart, an evicted template)
                t0 = time.perf_counter()
                if self._compiler is not None:
                    self._compiler.step_waits += 1
                concurrent.futures.wait([self._template])
                log.info("a step waited %.1f ms for a grammar build", (time.perf_counter() - t0) * 1000)
            try:
                self.matcher = self._template.result().deep_copy()
            except (ValueError, RuntimeError, OSError, TypeError) as e:
                self.error = f"grammar: {e}"
                return None
            self._consume()
        return None if self.error is not None else self.matcher

    def _consume(self) -> None:
        assert self.matcher is not None
        if self.pending and not self.matcher.consume_tokens(self.pending):
            self.error = _dead_end(self.matcher.get_error())
        self.pending.clear()


def _dead_end(library_error: str) -> str:
    """The row's error for a matcher that failed: the library's text goes to the log only."""
    log.warning("a grammar matcher failed: %s", library_error.splitlines()[0] if library_error else "?")
    return GRAMMAR_DEAD_END


class GrammarMasks(NamedTuple):
    """The allowed tokens of a batch's constrained rows: `bitmask[k]` is row `rows[k]`'s, bit
    `t % 32` of word `t // 32` set when token t is allowed."""

    rows: list[int]
    bitmask: torch.Tensor  # [len(rows), ceil(V / 32)] int32, on the CPU
    errors: dict[int, str]  # row -> why its grammar cannot constrain it (the row fails)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [B, V] float32 with every disallowed token of a constrained row at -inf (in place)."""
        allowed = unpack_bitmask(self.bitmask.to(logits.device, non_blocking=True), logits.shape[1])
        if len(self.rows) == logits.shape[0]:  # every row constrained (rows are in order)
            return logits.masked_fill_(~allowed, float("-inf"))
        idx = torch.tensor(self.rows, dtype=torch.int64, device=logits.device)
        # index_copy_, not `logits[idx] = ...`: index_put is far slower on CPU
        return logits.index_copy_(0, idx, logits.index_select(0, idx).masked_fill_(~allowed, float("-inf")))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 words -> [R, vocab_size] bool (token t allowed when bit t % 32 of word t // 32 is set)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()
