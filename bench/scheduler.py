"""`himamba bench scheduler`: what each Mamba track strategy costs and buys, side by side.

For a fixed device state pool, it floods one server per strategy with concurrent decoding
requests and samples the cache controller's pools: the peak number of running requests and
the state slots they hold (working + track + checkpoints). Then it runs the same multi-turn
conversations against each strategy and reports the cached-token ratio (the generated text of
a turn is only reusable with a track buffer). Prints a table; the last line is one JSON object.
Writes <out>/scheduler.json (the machine, the model, the workload and everything printed) and
<out>/scheduler.png (needs matplotlib: `pip install 'himamba[bench]'`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from himamba.bench.machine_info import describe_machine
from himamba.bench.model_info import describe_model
from himamba.bench.progress import Progress
from himamba.bench.report_files import write_json
from himamba.bench.scheduler_report import StrategyRow, compare, format_table, plot, summary_line
from himamba.bench.servers import ServerProcess, start_server
from himamba.common.client import AsyncClient

STRATEGIES = ("extra_buffer", "extra_buffer_lazy", "single_buffer", "no_buffer")
# Each conversation turn adds this many new tokens and generates this many.
_TURN_NEW, _TURN_GEN = 48, 24
# start_server's default, stated on the machine line.
_TORCH_THREADS = 1


def _log(msg: str) -> None:
    print(f"[bench scheduler] {msg}", file=sys.stderr, flush=True)


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, vocab) for _ in range(n)]


class _Sampler(threading.Thread):
    """Polls the cache controller's stats until stopped; keeps the peaks."""

    def __init__(self, server: ServerProcess):
        super().__init__(daemon=True)
        self.server = server
        self.stop_flag = threading.Event()
        self.peak_running = 0
        self.peak_held_slots = 0
        self.samples: list[tuple[int, int]] = []  # (running, held slots)

    def steady_slots_per_running(self) -> float:
        """State slots per running request at steady decode: the median over the samples taken
        at peak concurrency (a lazy boundary step's extra slot is brief, admission's checkpoint
        slots are gone once the prefill donated them)."""
        at_peak = [held / running for running, held in self.samples if running == self.peak_running and running]
        return round(statistics.median(at_peak), 2) if at_peak else 0.0

    def run(self) -> None:
        while not self.stop_flag.is_set():
            try:
                s = self.server.cache_stats(check_invariants=False, timeout_s=2.0)
            except TimeoutError:
                continue
            held = s.total_slots - s.free_slots - s.cached_slots  # slots owned by running requests
            self.peak_running = max(self.peak_running, s.running_requests)
            self.peak_held_slots = max(self.peak_held_slots, held)
            self.samples.append((s.running_requests, held))
            time.sleep(0.02)


async def _flood(endpoint: str, n: int, prompt_len: int, gen: int, vocab: int, progress: Progress) -> None:
    async with AsyncClient(endpoint) as c:

        async def one(i: int) -> None:
            await c.generate(input_ids=_tokens(prompt_len, 10_000 + i, vocab), max_tokens=gen, ignore_eos=True)
            progress.update()

        await asyncio.gather(*(one(i) for i in range(n)))


async def _conversations(
    endpoint: str, clients: int, turns: int, new: int, gen: int, vocab: int, progress: Progress
) -> tuple[int, int, int]:
    """Round-robin multi-turn traffic; returns (prompt tokens, cached tokens, ideal cached tokens)."""
    histories = {k: [] for k in range(clients)}
    prompt = cached = ideal = 0
    async with AsyncClient(endpoint) as c:
        for t in range(turns):
            for k in histories:
                prev = len(histories[k])
                histories[k] = histories[k] + _tokens(new, 1000 * k + t, vocab)
                out = await c.generate(input_ids=histories[k], max_tokens=gen, ignore_eos=True)
                prompt += len(histories[k])
                cached += out.usage.cached_tokens.total
                ideal += prev
                histories[k] = histories[k] + out.token_ids
                progress.update()
    return prompt, cached, ideal


def main(argv: list[str] | None = None) -> int:
    """Entry point of `himamba bench scheduler`; returns the exit status."""
    p = argparse.ArgumentParser(prog="himamba bench scheduler", description=__doc__)
    p.add_argument("--model", default="", help="checkpoint dir (default: a tiny random NemotronH built in a temp dir)")
    p.add_argument("--mamba-slots", type=int, default=40, help="device state pool size (fixed for every strategy)")
    p.add_argument("--requests", type=int, default=48, help="concurrent requests in the flood")
    p.add_argument("--prompt-len", type=int, default=40)
    p.add_argument("--gen", type=int, default=96)
    p.add_argument("--track-interval", type=int, default=16)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--out", default="himamba-bench-scheduler", help="folder for scheduler.json and scheduler.png")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--scale", action="store_true",
        help="instead: serial scheduler time per decode step at 32/256 running x 2k/32k context (scheduler_scale.py)",
    )  # fmt: skip
    p.add_argument("--forward-ms", type=float, default=5.0, help="--scale: the stand-in worker's time per forward")
    p.add_argument("--scale-steps", type=int, default=200, help="--scale: decode steps measured per case and round")
    p.add_argument(
        "--scale-rounds", type=int, default=3,
        help="--scale: rounds over the cases, in alternating order; a case's row is its median round",
    )  # fmt: skip
    p.add_argument(
        "--scale-cases", default="",
        help="--scale: cases as RUNNINGxCONTEXT[-penalty], comma-separated (default: "
        "32x2048,32x32768,256x2048,256x32768,256x2048-penalty)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.scale:
        from himamba.bench.scheduler_scale import CASES, parse_cases, run_scale

        try:
            cases = parse_cases(args.scale_cases) if args.scale_cases else CASES
        except ValueError as e:
            p.error(str(e))
        return run_scale(Path(args.out), args.forward_ms, args.scale_steps, cases, rounds=args.scale_rounds)
    strategies = [t.strip() for t in args.strategies.split(",") if t.strip()]
    # The checkpoint it builds and the servers' logs live only as long as the run.
    with tempfile.TemporaryDirectory(prefix="himamba-bench-") as tmp:
        return _run(args, strategies, Path(tmp))


def _run(args: argparse.Namespace, strategies: list[str], work: Path) -> int:
    model = args.model
    if not model:
        from himamba.services.modelgen.checkpoint import make_checkpoint

        _log("building a tiny random-weight NemotronH checkpoint")
        model = str(make_checkpoint("nemotron_h", work / "model", preset="tiny"))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    machine = describe_machine(_TORCH_THREADS, "cpu")
    model_info = describe_model(model, "" if args.model else "tiny", "float32")
    out_dir = Path(args.out)
    printed = [
        machine.line(),
        model_info.line(),
        f"fixed device state pool: {args.mamba_slots} slots; flood {args.requests} x (prompt {args.prompt_len}, "
        f"gen {args.gen}); {args.clients} clients x {args.turns} turns (+{_TURN_NEW} tokens, gen {_TURN_GEN} each)",
    ]
    for line in printed:
        print(line, flush=True)
    server_flags = [
        "--mamba-track-interval", str(args.track_interval),
        "--max-mamba-cache-size", str(args.mamba_slots),
        "--max-running-requests", str(args.requests),
        "--max-total-tokens", "65536",
    ]  # fmt: skip
    rows: list[StrategyRow] = []
    for strategy in strategies:
        _log(f"{strategy}: starting a server")
        server = start_server(model, work / "logs", "--mamba-scheduler-strategy", strategy, *server_flags)
        progress = Progress(args.requests + args.clients * args.turns, strategy, enabled=not args.no_progress)
        try:
            sampler = _Sampler(server)
            sampler.start()
            t0 = time.perf_counter()
            asyncio.run(_flood(server.endpoint, args.requests, args.prompt_len, args.gen, vocab, progress))
            flood_s = time.perf_counter() - t0
            sampler.stop_flag.set()
            sampler.join()
            turns = _conversations(server.endpoint, args.clients, args.turns, _TURN_NEW, _TURN_GEN, vocab, progress)
            prompt, cached, ideal = asyncio.run(turns)
            stats = server.cache_stats()
            rows.append(
                StrategyRow(
                    strategy=strategy,
                    peak_running=sampler.peak_running,
                    peak_held_slots=sampler.peak_held_slots,
                    slots_per_running=sampler.steady_slots_per_running(),
                    flood_tokens_per_s=round(args.requests * args.gen / flood_s, 1),
                    cached_ratio=round(cached / prompt, 4),
                    ideal_ratio=round(ideal / prompt, 4),
                    invariants_ok=stats.invariants_ok,
                )
            )
        finally:
            progress.close()
            server.stop()
    comparison = compare(rows)
    table = format_table(rows, comparison)
    for line in table:
        print(line)
    summary = summary_line(rows, comparison)
    title = f"himamba bench scheduler\n{machine.line()}\n{model_info.line()}"
    outcome = plot(out_dir / "scheduler.png", rows, title)
    notes = [] if outcome.written else [outcome.note]
    for note in notes:
        print(f"note: {note}")
    payload: dict[str, Any] = {
        "benchmark": "scheduler",
        "machine": machine._asdict(),
        "model": model_info._asdict(),
        "workload": {
            "mamba_slots": args.mamba_slots,
            "flood_requests": args.requests,
            "prompt_len": args.prompt_len,
            "gen": args.gen,
            "track_interval": args.track_interval,
            "clients": args.clients,
            "turns": args.turns,
            "turn_new_tokens": _TURN_NEW,
            "turn_gen_tokens": _TURN_GEN,
            "strategies": strategies,
        },
        "server_args": server_flags,
        "printed": [*printed, *table],
        "results": summary,
        "plot": "scheduler.png" if outcome.written else None,
        "notes": notes,
    }
    write_json(out_dir / "scheduler.json", payload)
    print(f"wrote {out_dir / 'scheduler.json'}" + (f" and {out_dir / 'scheduler.png'}" if outcome.written else ""))
    print(json.dumps(summary))
    return 0
