"""`himamba bench serve-overhead`: what the server adds per generated token over the worker's steps.

One `himamba serve` (radix cache off) on the bench's checkpoint; requests of `--prompt-len` random
tokens + `--new-tokens` greedy tokens (eos ignored), `--batches` at once, `--runs` rounds alternating
the batch sizes. End-to-end time is the client's wall time from sending the batch to its last token;
the worker's time is the growth of `himamba_worker_step_time_seconds_sum` (every step's forward,
sampling and copy orders) over the round, scraped from /metrics once the worker has reported it.
Server overhead per token = (end-to-end - worker) / new tokens. Writes `serve_overhead.json` under --out.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

from himamba.common.client import Client
from himamba.services.bench.servers import start_server
from himamba.services.worker.bench_forward import checkpoint_dir

_STEP_SUM = re.compile(r"^himamba_worker_step_time_seconds_sum\{[^}]*\} (\S+)$", re.MULTILINE)
_REPORT_INTERVAL_S = 0.2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_step_seconds(port: int) -> float:
    """The worker's step time so far (all batch modes), from the server's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(v) for v in _STEP_SUM.findall(text))


def _settled_step_seconds(port: int) -> float:
    """The worker's step time once its latest report is in (it reports every _REPORT_INTERVAL_S)."""
    time.sleep(4 * _REPORT_INTERVAL_S)
    return worker_step_seconds(port)


def _run_batch(endpoint: str, prompts: list[list[int]], new_tokens: int) -> float:
    """Send every prompt at once (one client each); wall seconds until the last one is done."""
    done = [0] * len(prompts)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            with Client(endpoint) as c:
                done[i] = len(c.generate(input_ids=prompts[i], max_tokens=new_tokens, ignore_eos=True).token_ids)
        except Exception as e:  # noqa: BLE001  # re-raised in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    if done != [new_tokens] * len(prompts):
        raise RuntimeError(f"expected {new_tokens} tokens per request, got {done}")
    return wall


def run(args: argparse.Namespace, out: Any) -> dict[str, Any]:
    """Start the server, measure every round, print the table; returns the JSON summary."""
    ckpt = args.checkpoint or checkpoint_dir(args.arch, args.preset, args.seed)
    port = _free_port()
    flags = ["--torch-threads", str(args.threads), "--disable-radix-cache", "--port", str(port)]
    flags += ["--report-interval-s", str(_REPORT_INTERVAL_S)]
    server = start_server(ckpt, Path(args.out) / "logs", *flags, ready_timeout_s=600)
    gen = torch.Generator().manual_seed(args.seed)
    vocab = json.loads((Path(ckpt) / "config.json").read_text())["vocab_size"]
    rounds: dict[int, list[dict[str, float]]] = {b: [] for b in args.batches}
    try:
        _run_batch(server.endpoint, [[1] * args.prompt_len], 2)  # warm-up
        for r in range(args.runs):
            for batch in args.batches:
                prompts = [torch.randint(1, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(batch)]
                before = _settled_step_seconds(port)
                wall = _run_batch(server.endpoint, prompts, args.new_tokens)
                worker = _settled_step_seconds(port) - before
                rounds[batch].append({"e2e_s": wall, "worker_s": worker})
                sys.stderr.write(f"round {r + 1}/{args.runs} batch {batch}: e2e {wall:.3f} s, worker {worker:.3f} s\n")
    finally:
        server.stop()
    rows = []
    out.write(
        f"server overhead: {args.arch} {args.preset}, {args.prompt_len}-token prompts + {args.new_tokens} greedy tokens, "
        f"radix cache off, {args.threads} torch threads; medians [min-max] of {args.runs} runs\n"
        f"{'batch':>6}{'e2e s':>22}{'worker s':>22}{'server ms/token':>26}{'share':>8}\n"
    )
    for batch, runs in rounds.items():
        per_token = [1e3 * (x["e2e_s"] - x["worker_s"]) / args.new_tokens for x in runs]
        e2e, worker = [x["e2e_s"] for x in runs], [x["worker_s"] for x in runs]
        share = statistics.median((x["e2e_s"] - x["worker_s"]) / x["e2e_s"] for x in runs)
        rows.append(
            {
                "batch": batch,
                "runs": runs,
                "server_ms_per_token": statistics.median(per_token),
                "server_ms_per_token_min": min(per_token),
                "server_ms_per_token_max": max(per_token),
                "server_share": share,
            }
        )
        out.write(
            f"{batch:>6}{_spread(e2e, '.3f'):>22}{_spread(worker, '.3f'):>22}{_spread(per_token, '.2f'):>26}"
            f"{100 * share:>7.1f}%\n"
        )
    summary = {"bench": "serve-overhead", "checkpoint": str(ckpt), "options": _jsonable(vars(args)), "rows": rows}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "serve_overhead.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _spread(values: list[float], spec: str) -> str:
    return f"{format(statistics.median(values), spec)} [{format(min(values), spec)}-{format(max(values), spec)}]"


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in d.items()}


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="himamba bench serve-overhead", description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="nemotron_h")
    p.add_argument("--preset", default="medium")
    p.add_argument("--checkpoint", type=Path, default=None, help="use this model directory instead")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="the server's torch threads")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batches", type=_int_list, default=[1, 8])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default="himamba-bench-serve-overhead")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    for name in ("threads", "prompt_len", "new_tokens", "runs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    run(args, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
