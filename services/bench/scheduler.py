"""`himamba bench scheduler`: what each Mamba track strategy costs and buys, side by side.

For a fixed device state pool, it floods one server per strategy with concurrent decoding
requests and samples the cache controller's pools: the peak number of running requests and
the state slots they hold (working + track + checkpoints). Then it runs the same multi-turn
conversations against each strategy and reports the cached-token ratio (the generated text of
a turn is only reusable with a track buffer). Prints a table; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

from himamba.common.client import AsyncClient
from himamba.services.bench.servers import ServerProcess, start_server

STRATEGIES = ("extra_buffer", "extra_buffer_lazy", "no_buffer")


def _progress(msg: str) -> None:
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

    def run(self) -> None:
        while not self.stop_flag.is_set():
            try:
                s = self.server.cache_stats(check_invariants=False, timeout_s=2.0)
            except TimeoutError:
                continue
            held = s.total_slots - s.free_slots - s.cached_slots  # slots owned by running requests
            self.peak_running = max(self.peak_running, s.running_requests)
            self.peak_held_slots = max(self.peak_held_slots, held)
            time.sleep(0.02)


async def _flood(endpoint: str, n: int, prompt_len: int, gen: int, vocab: int) -> None:
    async with AsyncClient(endpoint) as c:
        await asyncio.gather(
            *(c.generate(input_ids=_tokens(prompt_len, 10_000 + i, vocab), max_tokens=gen, ignore_eos=True) for i in range(n))
        )


async def _conversations(endpoint: str, clients: int, turns: int, new: int, gen: int, vocab: int) -> tuple[int, int, int]:
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
    return prompt, cached, ideal


def main(argv: list[str] | None = None) -> int:
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
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="himamba-bench-"))
    model = args.model
    if not model:
        from himamba.services.modelgen.checkpoint import make_checkpoint

        _progress("building a tiny random-weight NemotronH checkpoint")
        model = str(make_checkpoint("nemotron_h", work / "model", preset="tiny"))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rows = []
    for strategy in args.strategies.split(","):
        _progress(f"{strategy}: starting a server")
        server = start_server(
            model, work / "logs",
            "--mamba-scheduler-strategy", strategy, "--mamba-track-interval", str(args.track_interval),
            "--max-mamba-cache-size", str(args.mamba_slots), "--max-running-requests", str(args.requests),
            "--max-total-tokens", "65536",
        )
        try:
            _progress(f"{strategy}: {args.requests} concurrent requests")
            sampler = _Sampler(server)
            sampler.start()
            t0 = time.perf_counter()
            asyncio.run(_flood(server.endpoint, args.requests, args.prompt_len, args.gen, vocab))
            flood_s = time.perf_counter() - t0
            sampler.stop_flag.set()
            sampler.join()
            _progress(f"{strategy}: multi-turn conversations")
            prompt, cached, ideal = asyncio.run(_conversations(server.endpoint, args.clients, args.turns, 48, 24, vocab))
            stats = server.cache_stats()
            rows.append(
                dict(
                    strategy=strategy,
                    peak_running=sampler.peak_running,
                    peak_held_slots=sampler.peak_held_slots,
                    slots_per_running=round(sampler.peak_held_slots / max(sampler.peak_running, 1), 2),
                    flood_tokens_per_s=round(args.requests * args.gen / flood_s, 1),
                    cached_ratio=round(cached / prompt, 4),
                    ideal_ratio=round(ideal / prompt, 4),
                    invariants_ok=stats.invariants_ok,
                )
            )
        finally:
            server.stop()
    print(f"machine: {os.cpu_count()} cores, torch threads 1 per server, device cpu; model {model}")
    print(f"fixed device state pool: {args.mamba_slots} slots; flood {args.requests} x (prompt {args.prompt_len}, gen {args.gen})")
    head = f"{'strategy':<18} {'peak running':>12} {'held slots':>10} {'slots/req':>9} {'tok/s':>8} {'cached':>7} {'ideal':>6}"
    print(head)
    for r in rows:
        print(
            f"{r['strategy']:<18} {r['peak_running']:>12} {r['peak_held_slots']:>10} {r['slots_per_running']:>9} "
            f"{r['flood_tokens_per_s']:>8} {r['cached_ratio']:>7} {r['ideal_ratio']:>6}"
        )
    by = {r["strategy"]: r for r in rows}
    summary: dict[str, object] = {"rows": rows}
    if "extra_buffer" in by and "extra_buffer_lazy" in by:
        ratio = by["extra_buffer_lazy"]["peak_running"] / max(by["extra_buffer"]["peak_running"], 1)
        summary["lazy_vs_extra_concurrency"] = round(ratio, 2)
        print(f"lazy / extra_buffer peak concurrency: {ratio:.2f}x (3 slots per request vs 2 -> ~1.5x expected)")
    print(json.dumps(summary))
    return 0
