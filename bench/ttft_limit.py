"""The limit of caching for a later turn's time to first token: the worker prefilling only that
turn's new tokens over a history it already holds, measured in the bench's own process with the
same checkpoint, dtype and thread count as the servers (the servers are stopped by then).

A served later turn cannot beat this: its prefix is in the cache and only the new user message is
computed. What a served TTFT adds on top is the rest of the system (the front door, queueing, the
scheduler's admission round trip, copies from host or storage).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import NamedTuple

import torch

from himamba.bench.forward import OurEngine
from himamba.bench.step_times import StepTimes
from himamba.bench.workload import WorkloadSpec
from himamba.services.worker.loader import load_model

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TtftLimit(NamedTuple):
    """Prefill time of a later turn's new tokens over its cached history."""

    new_tokens: int
    prefix_lens: list[int]  # the histories measured (one per later round)
    seconds: float  # median over `prefix_lens` of the best of `repeats`


def later_prefix_lens(spec: WorkloadSpec, first_round: int) -> list[int]:
    """The cached history in front of each later round's new message."""
    per_round = spec.sub_question_length + spec.output_length
    return [spec.request_length + r * per_round - spec.sub_question_length for r in range(first_round, spec.num_rounds)]


def measure_ttft_limit(
    model_dir: Path, dtype: str, threads: int, spec: WorkloadSpec, first_round: int, repeats: int = 3
) -> TtftLimit:
    """Time the prefill of `spec.sub_question_length` tokens over each later round's history."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        model = load_model(model_dir, dtype=_DTYPES[dtype])
        prefixes = later_prefix_lens(spec, first_round) or [spec.request_length]
        new = spec.sub_question_length
        engine = OurEngine(model, 16, max(prefixes) + new + 64, 2)
        gen = torch.Generator().manual_seed(0)
        vocab = model.vocab_size
        best: list[float] = []
        for prefix in prefixes:
            times = []
            for _ in range(repeats):
                seq = engine.new_seq()
                history = torch.randint(1, vocab, (prefix,), generator=gen).tolist()
                engine.step("prefill", [seq], [history], StepTimes())  # the cached history (not timed)
                turn = torch.randint(1, vocab, (new,), generator=gen).tolist()
                t0 = time.perf_counter()
                engine.step("prefill", [seq], [turn], StepTimes())
                times.append(time.perf_counter() - t0)
                engine.release([seq])
            best.append(min(times))
        return TtftLimit(new, prefixes, statistics.median(best))
    finally:
        torch.set_num_threads(before)
