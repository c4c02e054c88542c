"""The honest reference of `himamba bench forward`: each engine generating the way its users run it.

transformers runs its own `model.generate` (its own cache, greedy, eos ignored), warm, in this
process with the bench's threads and dtype. vLLM (`--peer vllm`) runs its CPU engine (`LLM.generate`,
enforce_eager, prefix caching off) in the peer's own Python (`--peer-python`), bound to as many CPUs
as the bench has threads, on the same checkpoint, dtype and token ids. Ours runs the worker's step
(RunBatch -> build_forward_batch -> forward -> sample) over the paged pools.

Every engine is timed the same way, inside one request of N new tokens: t_first, when every
sequence has its first new token (the prefill and first sampling), and t, when the request is done;
prefill tok/s = prompt tokens / t_first, decode tok/s = B (N - 1) / (t - t_first). Runs alternate between the engines (the order rotates every run) so that load from
other processes hits all of them alike; medians and [min, max] over the runs are printed.

Greedy agreement is checked on each scenario's first sequence, up to the first step where any
engine's top-2 logit gap is below `near_tie` (random weights make near-ties, and different GEMM
kernels may flip them); the bench reports that step.
"""

from __future__ import annotations

import json
import select
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol, TextIO

import torch

from himamba.bench.step_times import StepTimes

PEER_SCRIPT = Path(__file__).with_name("peer_vllm.py")


@dataclass(frozen=True)
class Scenario:
    """`batch` prompts of `prompt_len` tokens each, then `new_tokens` greedy tokens."""

    name: str  # "decode B=8" | "prefill L=512"
    phase: str  # "decode" | "prefill": which rate the scenario is about
    batch: int
    prompt_len: int
    new_tokens: int


@dataclass
class Generated:
    """One request's outcome: wall seconds (all of it, and until every sequence's first new token),
    the new tokens, and (when asked) each step's top-2 gap."""

    seconds: float
    first_seconds: float
    tokens: list[list[int]]
    gaps: list[list[float]] | None = None


class GenerateEngine(Protocol):
    name: str

    def generate(self, prompts: list[list[int]], new_tokens: int, gaps: bool = False) -> Generated: ...

    def close(self) -> None: ...


def _top2_gaps(logits: torch.Tensor) -> list[float]:
    """logits [B, V] -> the top-2 difference of each row."""
    top = logits.float().topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


class OursGenerate:
    """Our worker's step loop (the bench's OurEngine): one prefill step, then decode steps."""

    name = "ours"

    def __init__(self, engine: Any) -> None:
        self.engine = engine  # forward.OurEngine

    def generate(self, prompts: list[list[int]], new_tokens: int, gaps: bool = False) -> Generated:
        seqs = [self.engine.new_seq() for _ in prompts]
        times = StepTimes()
        out: list[list[int]] = [[] for _ in prompts]
        step_gaps: list[list[float]] = [[] for _ in prompts]
        t0 = time.perf_counter()
        tokens = self.engine.step("prefill", seqs, prompts, times)
        first = time.perf_counter() - t0
        for _ in range(new_tokens):
            if gaps:
                for g, gap in zip(step_gaps, _top2_gaps(self.engine.last_logits), strict=True):
                    g.append(gap)
            for o, t in zip(out, tokens, strict=True):
                o.append(t)
            if len(out[0]) == new_tokens:
                break
            tokens = self.engine.step("decode", seqs, [[t] for t in tokens], times)
        seconds = time.perf_counter() - t0
        self.engine.release(seqs)
        return Generated(seconds, first, out, step_gaps if gaps else None)

    def close(self) -> None:
        pass


class HFGenerate:
    """transformers' `model.generate`: its own cache, greedy, never stopping at eos."""

    name = "transformers"

    def __init__(self, model: Any) -> None:
        self.model = model
        model.generation_config.eos_token_id = None
        if model.generation_config.pad_token_id is None:
            model.generation_config.pad_token_id = 0

    def generate(self, prompts: list[list[int]], new_tokens: int, gaps: bool = False) -> Generated:
        ids = torch.tensor(prompts)
        kwargs: dict[str, Any] = {"output_logits": True, "return_dict_in_generate": True} if gaps else {}
        stamp = _FirstTokenTime()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                streamer=stamp,
                **kwargs,
            )
        seconds = time.perf_counter() - t0
        sequences = out.sequences if gaps else out
        tokens = sequences[:, ids.shape[1] :].tolist()
        step_gaps = None
        if gaps:
            per_step = [_top2_gaps(step) for step in out.logits]  # [steps][B]
            step_gaps = [list(col) for col in zip(*per_step, strict=True)]
        assert stamp.at is not None
        return Generated(seconds, stamp.at - t0, tokens, step_gaps)

    def close(self) -> None:
        pass


class _FirstTokenTime:
    """A transformers streamer that only notes when the first new tokens come out (`generate` hands
    it the prompt first, then each step's tokens)."""

    def __init__(self) -> None:
        self.calls = 0
        self.at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        del value
        self.calls += 1
        if self.calls == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


class PeerError(RuntimeError):
    """An engine compared against cannot run: a peer's process failed (the message carries the end
    of its stderr), or transformers, the reference, is not installed."""


class VLLMPeer:
    """vLLM's CPU engine in the peer's Python, spoken to over pipes (peer_vllm.py)."""

    name = "vllm"

    def __init__(
        self,
        python: Path,
        model_dir: Path,
        dtype: str,
        threads: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        log: TextIO,
        verbose: bool = False,
        kv_cache_gib: int = 1,
        start_timeout_s: float = 600.0,
        script: Path = PEER_SCRIPT,
    ) -> None:
        """Start the peer and wait for its ready line (vLLM's start takes a while: imports, load)."""
        args = {
            "model": str(model_dir),
            "dtype": dtype,
            "threads": threads,
            "max_model_len": max_model_len,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "kv_cache_gib": kv_cache_gib,
        }
        self.proc = subprocess.Popen(
            [str(python), str(script), json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self._err_lines: list[str] = []
        self._log = log
        self._verbose = verbose
        self._reader = threading.Thread(target=self._drain, args=(self.proc.stderr,), daemon=True)
        self._reader.start()
        ready = self._read(start_timeout_s)
        self.version = str(ready.get("version", "?"))

    def _drain(self, stream: IO[str] | None) -> None:
        """Keep the end of the peer's stderr (for errors); `log` gets it whole when verbose."""
        assert stream is not None
        for line in stream:
            self._err_lines = (self._err_lines + [line.rstrip()])[-40:]
            if self._verbose:
                self._log.write("[vllm] " + line)

    def _read(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            self._reader.join(timeout=10)  # the end of its stderr is what explains the failure
            tail = "\n".join(self._err_lines[-20:])
            raise PeerError(f"the vLLM peer gave no answer (exit {self.proc.poll()}); its stderr ends:\n{tail}")
        return json.loads(line)

    def generate(self, prompts: list[list[int]], new_tokens: int, gaps: bool = False) -> Generated:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": new_tokens, "gaps": gaps}) + "\n")
        self.proc.stdin.flush()
        answer = self._read(600.0)
        return Generated(
            float(answer["seconds"]),
            float(answer["first_seconds"]),
            answer["tokens"],
            answer["top2_gaps"] if gaps else None,
        )

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Rates:
    """One engine's rates over the runs of a scenario (tok/s per run)."""

    prefill: list[float] = field(default_factory=list)
    decode: list[float] = field(default_factory=list)

    def of(self, phase: str) -> list[float]:
        return self.prefill if phase == "prefill" else self.decode


@dataclass
class Agreement:
    """Greedy tokens of an engine against ours on a scenario's first sequence."""

    engine: str
    compared_steps: int  # steps checked (before the first near-tie)
    total_steps: int
    near_tie_step: int | None  # first step with a top-2 gap below near_tie in either engine
    first_mismatch: int | None  # first step checked whose tokens differ (None: they agree)

    def describe(self) -> str:
        if self.first_mismatch is not None:
            return f"{self.engine}: DIFFERS at step {self.first_mismatch}"
        if self.near_tie_step is None:
            return f"{self.engine}: agrees on all {self.total_steps} steps (no near-tie)"
        return (
            f"{self.engine}: agrees on steps 0-{self.near_tie_step - 1}; near-tie at step {self.near_tie_step}, "
            "not compared after"
        )


def agreement(engine: str, ours: Generated, theirs: Generated, near_tie: float) -> Agreement:
    """Compare the first sequence of two gap-carrying results, step by step, up to the first near-tie."""
    assert ours.gaps is not None and theirs.gaps is not None
    mine, other = ours.tokens[0], theirs.tokens[0]
    steps = min(len(mine), len(other))
    for step in range(steps):
        if min(ours.gaps[0][step], theirs.gaps[0][step]) < near_tie:
            return Agreement(engine, step, steps, step, None)
        if mine[step] != other[step]:
            return Agreement(engine, step, steps, None, step)
    return Agreement(engine, steps, steps, None, None)


@dataclass
class ScenarioResult:
    scenario: Scenario
    rates: dict[str, Rates]
    agreements: list[Agreement]


def run_scenarios(
    engines: list[GenerateEngine],
    scenarios: list[Scenario],
    runs: int,
    near_tie: float,
    make_prompts: Callable[[int, int], list[list[int]]],
    progress: Callable[[str], None],
) -> list[ScenarioResult]:
    """Warm every engine on each scenario, check greedy agreement, then `runs` alternating timed runs."""
    results = []
    for sc in scenarios:
        prompts = make_prompts(sc.batch, sc.prompt_len)
        gapped = {e.name: e.generate(prompts, sc.new_tokens, gaps=True) for e in engines}  # also the warm-up
        progress(f"{sc.name}: warm-up and greedy agreement")
        agreements = [agreement(e.name, gapped["ours"], gapped[e.name], near_tie) for e in engines if e.name != "ours"]
        rates = {e.name: Rates() for e in engines}
        for r in range(runs):
            order = engines[r % len(engines) :] + engines[: r % len(engines)]
            for e in order:
                done = e.generate(prompts, sc.new_tokens)
                rates[e.name].prefill.append(sc.batch * sc.prompt_len / done.first_seconds)
                if sc.new_tokens > 1:
                    rates[e.name].decode.append(sc.batch * (sc.new_tokens - 1) / (done.seconds - done.first_seconds))
            progress(f"{sc.name}: run {r + 1}/{runs}")
        results.append(ScenarioResult(sc, rates, agreements))
    return results


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):9.1f} [{min(values):.0f}-{max(values):.0f}]"


def print_results(out: TextIO, results: list[ScenarioResult], engines: list[str], runs: int, near_tie: float) -> None:
    """The side-by-side table: tok/s median [min-max] per engine, ours / theirs ratios of the medians."""
    peers = [e for e in engines if e != "ours"]
    out.write(
        f"\ngenerate, each engine as its users run it (medians [min-max] of {runs} alternating runs; "
        "ratio = ours / theirs)\n"
    )
    header = f"{'scenario':<15}{'tokens':>12}{'ours tok/s':>22}"
    for p in peers:
        header += f"{p + ' tok/s':>22}{'ratio':>7}"
    out.write(header + "\n" + "-" * len(header) + "\n")
    for res in results:
        sc = res.scenario
        ours = res.rates["ours"].of(sc.phase)
        line = f"{sc.name:<15}{f'{sc.batch}x{sc.prompt_len}+{sc.new_tokens}':>12}{_spread(ours):>22}"
        for p in peers:
            theirs = res.rates[p].of(sc.phase)
            line += f"{_spread(theirs):>22}{statistics.median(ours) / statistics.median(theirs):>7.2f}"
        out.write(line + "\n")
    out.write(
        "one request of N new tokens per run: prefill tok/s = B L / t(first new tokens), decode tok/s =\n"
        "B (N - 1) / (t(done) - t(first new tokens)).\n"
        f"greedy agreement with ours (first sequence of each scenario; compared up to the first step whose\n"
        f"top-2 logit gap is below {near_tie:g} in either engine):\n"
    )
    for res in results:
        out.write(f"  {res.scenario.name}: " + "; ".join(a.describe() for a in res.agreements) + "\n")


def summary(results: list[ScenarioResult]) -> list[dict[str, Any]]:
    """The JSON form of the results."""
    rows = []
    for res in results:
        sc = res.scenario
        row: dict[str, Any] = {
            "scenario": sc.name,
            "phase": sc.phase,
            "batch": sc.batch,
            "prompt_len": sc.prompt_len,
            "new_tokens": sc.new_tokens,
        }
        for name, rates in res.rates.items():
            values = rates.of(sc.phase)
            row[name] = {
                "median_tok_s": statistics.median(values),
                "min": min(values),
                "max": max(values),
                "runs": values,
            }
        ours = statistics.median(res.rates["ours"].of(sc.phase))
        row["ratios"] = {
            name: ours / statistics.median(rates.of(sc.phase)) for name, rates in res.rates.items() if name != "ours"
        }
        row["agreement"] = [a.__dict__ for a in res.agreements]
        rows.append(row)
    return rows
