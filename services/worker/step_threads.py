"""How many torch threads each worker step runs on, learned per step size (CPU only).

The server's OpenMP threads sleep between parallel regions (OMP_WAIT_POLICY=PASSIVE, so that they
never spin against the other services), which makes every parallel op wake them again. A
small-batch decode step is hundreds of ops with little work in each: on a 2-core AMD EPYC
(medium NemotronH, float32) one thread ran a batch-1 decode step in 6.9 ms against 7.8 ms on two,
batch 8 in 9.7 against 11.7 ms, batch 16 about equal, while batch 32 was faster on two (21.3
against 23.6 ms; medians of 5 alternating rounds). Where the crossover lies depends on the
machine, the model and the load, so it is measured: steps of up to `LEARN_MAX_TOKENS` tokens are
grouped by token count (powers of two); each group keeps a running mean of its step time under
each candidate (1 thread and the configured count), runs the faster and tries the other again
every `explore_every` steps. Larger steps (bigger decode batches, prefill chunks) always get the
configured count: near the crossover the noise of a shared machine would pick wrongly as often
as rightly, and above it one thread only loses.

A one-thread step may still run its vocabulary head on every thread (`Plan.head_threads`): the
head is one large matrix-vector product, so its second thread is worth the single wake-up where
the layers' many small products are not. Same box and model: batch 1 6.97 -> 6.52 ms per step,
batch 8 9.49 -> 9.26 ms (medians of 9 alternating rounds). A tiny vocabulary may not repay the
wake-up, so "one thread, head on one" stays a candidate and the measurements decide.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

LEARN_MAX_TOKENS = 16
_ALPHA = 0.25  # weight of a new sample in the running mean
_FIRST_SAMPLES = 3  # samples of each candidate before the group picks (the first steps are cold)


class Plan(NamedTuple):
    """The torch threads of one step: `threads` for the layers, `head_threads` for the vocabulary head."""

    threads: int
    head_threads: int

    def describe(self) -> str:
        head = "" if self.head_threads == self.threads else f", head on {self.head_threads}"
        return f"{self.threads} thread(s){head}"


class Choice(NamedTuple):
    """A size class's pick changed: steps of `low`..`high` tokens now run on `plan`."""

    low: int
    high: int
    plan: Plan
    mean_s: dict[Plan, float]  # the running mean step time under each candidate
    first: bool  # the class's first pick (later ones follow the load, and may flip back and forth)

    def describe(self) -> str:
        times = ", ".join(f"{p.describe()} {1e3 * s:.2f} ms" for p, s in sorted(self.mean_s.items(), reverse=True))
        return f"steps of {self.low}-{self.high} tokens now run on {self.plan.describe()} ({times})"


@dataclass
class _Group:
    mean: dict[Plan, float] = field(default_factory=dict)  # running mean seconds per step
    samples: dict[Plan, int] = field(default_factory=dict)
    steps: int = 0
    best: Plan | None = None  # the current pick, once every candidate has a mean


class StepThreads:
    """Picks the threads of a step (a `Plan`) from its token count; `record` feeds back the step's time."""

    def __init__(
        self, max_threads: int, explore_every: int = 64, on_choice: Callable[[Choice], None] | None = None
    ) -> None:
        if max_threads < 1 or explore_every < 2:
            raise ValueError(f"max_threads must be >= 1 and explore_every >= 2, got {max_threads}, {explore_every}")
        self.max_threads = max_threads
        self.full = Plan(max_threads, max_threads)
        self.candidates = (self.full, Plan(1, max_threads), Plan(1, 1)) if max_threads > 1 else (self.full,)
        self.explore_every = explore_every
        self.on_choice = on_choice  # told of every change of a size class's pick (the worker logs it)
        self._groups: dict[int, _Group] = {}

    @contextlib.contextmanager
    def step(self, tokens: int) -> Iterator[Plan]:
        """Run the body, one step of `tokens` tokens, on the picked threads (it runs the head on
        the plan's `head_threads`); learn from its time."""
        plan = self.pick(tokens)
        if plan.threads != torch.get_num_threads():  # whoever ran before may have left another count
            torch.set_num_threads(plan.threads)
        t0 = time.perf_counter()
        try:
            yield plan
        finally:
            # Whatever runs between steps (copy orders; transformers in the bench) gets every thread.
            torch.set_num_threads(self.max_threads)
        choice = self.record(tokens, plan, time.perf_counter() - t0)
        if choice is not None and self.on_choice is not None:
            self.on_choice(choice)

    def pick(self, tokens: int) -> Plan:
        """The plan of a step of `tokens` new tokens."""
        if len(self.candidates) == 1 or tokens > LEARN_MAX_TOKENS:
            return self.full
        group = self._groups.setdefault(tokens.bit_length(), _Group())
        for plan in self.candidates:
            if group.samples.get(plan, 0) < _FIRST_SAMPLES:
                return plan
        group.steps += 1
        best = group.best
        assert best is not None  # set by `record` once every candidate has a mean
        if group.steps % self.explore_every == 0:  # retry the others in turn
            others = [p for p in self.candidates if p != best]
            return others[(group.steps // self.explore_every) % len(others)]
        return best

    def record(self, tokens: int, plan: Plan, seconds: float) -> Choice | None:
        """The step of `tokens` tokens ran on `plan` in `seconds`; returns the size class's new
        pick when this changed it (the worker logs it)."""
        if len(self.candidates) == 1 or tokens > LEARN_MAX_TOKENS or plan not in self.candidates:
            return None
        key = tokens.bit_length()
        group = self._groups.setdefault(key, _Group())
        n = group.samples.get(plan, 0)
        # The first sample of each candidate is skipped (caches and allocator are cold).
        if n >= 1:
            old = group.mean.get(plan)
            group.mean[plan] = seconds if old is None else old + _ALPHA * (seconds - old)
        group.samples[plan] = n + 1
        if not all(p in group.mean for p in self.candidates):
            return None
        best = min(self.candidates, key=lambda p: group.mean[p])
        if best == group.best:
            return None
        first = group.best is None
        group.best = best
        return Choice(1 << (key - 1), (1 << key) - 1, best, dict(group.mean), first)

    def choices(self) -> dict[int, Plan]:
        """For each learned group (its largest token count), the plan it picks now."""
        return {(1 << key) - 1: g.best for key, g in sorted(self._groups.items()) if g.best is not None}


@contextlib.contextmanager
def threads_for(count: int | None) -> Iterator[None]:
    """Run the body on `count` torch threads (None: as many as now), then restore the count."""
    before = torch.get_num_threads()
    if count is None or count == before:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
