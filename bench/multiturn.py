"""`himamba bench multiturn`: multi-turn serving under each cache configuration, side by side.

N clients each hold a conversation of R rounds; each round sends the whole history plus a new
user message of L random token ids and asks for O tokens (greedy, ignore_eos). Arrivals are
open loop at a request rate (poisson or uniform gaps) with at most `--max-parallel` in flight;
`--request-rate inf` makes it a closed loop. Flags and defaults mirror sglang's
benchmark/hicache/bench_multiturn.py so figures compare.

Each configuration runs against a server the bench starts itself:
  none     --disable-radix-cache
  device   --no-enable-hierarchical-cache (device tier only)
  host     device + host tier (storage off)
  storage  device + host + the file storage backend in a fresh temporary directory (when the
           server has `--hicache-storage-backend`; else skipped with a note)

With `--peer-url URL` every round goes over HTTP instead (OpenAI `/v1/completions`, streamed, token
ids in and out: `openai_turns.py`), to our servers (started with an HTTP port) and to the peer, any
OpenAI-compatible server on the same checkpoint (vLLM's `vllm serve`, with prefix caching on or off;
sglang's): the same conversations through the same client, and a table of TTFT p50/p99 and throughput
side by side, ours against the peer's (the `peer` row).

Prints two tables (latency/throughput; cached-token ratio per tier against the workload's ideal
and ratios against `none`), writes <out>/multiturn.json and <out>/multiturn.png (the PNG needs
matplotlib: `pip install 'himamba[bench]'`). Every output states the machine and the model.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import math
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from himamba.bench.arrivals import Arrivals
from himamba.bench.http_completions import served_model
from himamba.bench.latency_summary import LATE_ROUND, RunSummary, add_ratios_vs_none, summarize
from himamba.bench.machine_info import describe_machine
from himamba.bench.model_info import describe_model
from himamba.bench.multiturn_driver import TurnClient, ZmqTurns, run_multiturn
from himamba.bench.multiturn_report import format_tables, goal_lines, limit_lines, peer_comparison, peer_table, plot
from himamba.bench.openai_turns import OpenAITurns
from himamba.bench.progress import Progress
from himamba.bench.report_files import write_json
from himamba.bench.servers import ServerProcess, free_port, himamba_command, start_server
from himamba.bench.ttft_limit import measure_ttft_limit
from himamba.bench.workload import Turn, WorkloadSpec, ordinary_token_ids
from himamba.common.config import ModelConfig, resolve_dtype

CONFIGS = ("none", "device", "host", "storage")
PEER = "peer"  # the row of the server at --peer-url
_STORAGE_FLAG = "--hicache-storage-backend"
_SERVER_DEFAULT_CONTEXT = 4096
_DEMO_ARCH = "nemotron_h"


def _log(msg: str) -> None:
    print(f"[bench multiturn] {msg}", file=sys.stderr, flush=True)


def parse_rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"a request rate must be > 0 (or inf), got {text!r}")
    return rate


def parse_rates(text: str) -> list[float]:
    rates = [parse_rate(t) for t in text.split(",") if t.strip()]
    if not rates:
        raise argparse.ArgumentTypeError("--sweep needs at least one rate, e.g. 1,2,4,inf")
    return rates


def parse_configs(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in CONFIGS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"--configs takes a list of {','.join(CONFIGS)}, got {text!r}")
    return list(dict.fromkeys(names))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="himamba bench multiturn", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    w = p.add_argument_group("workload (sglang bench_multiturn's flags and defaults)")
    w.add_argument("--num-clients", type=int, default=256, help="conversations (default 256)")
    w.add_argument("--max-parallel", type=int, default=128, help="requests in flight at most (default 128)")
    w.add_argument("--request-length", type=int, default=512, help="tokens of each conversation's first message")
    w.add_argument(
        "--sub-question-input-length", type=int, default=0, help="tokens of each later message (0: --request-length)"
    )
    w.add_argument("--output-length", type=int, default=64, help="tokens generated per round (ignore_eos)")
    w.add_argument("--num-rounds", type=int, default=5, help="rounds per conversation")
    w.add_argument("--distribution", choices=("poisson", "uniform"), default="poisson", help="arrival gaps")
    w.add_argument("--request-rate", type=parse_rate, default=1.0, help="requests/s (inf: closed loop)")
    w.add_argument("--ready-queue-policy", choices=("random", "fifo"), default="random")
    w.add_argument("--seed", type=int, default=1)
    w.add_argument("--sweep", type=parse_rates, default=None, help="comma-separated request rates to run in turn")
    s = p.add_argument_group("servers")
    s.add_argument("--configs", type=parse_configs, default=list(CONFIGS), help="subset of none,device,host,storage")
    s.add_argument("--model", default="", help="checkpoint dir (default: the demo NemotronH of --preset, built once)")
    s.add_argument("--preset", choices=("tiny", "medium"), default="tiny", help="demo model size (without --model)")
    s.add_argument("--torch-threads", type=int, default=0, help="torch threads of each server's worker (0: default)")
    s.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    s.add_argument("--server-args", default="", help="extra `himamba serve` flags for every configuration")
    s.add_argument(
        "--endpoint", default="", help="bench this running server instead (one row, 'external'; needs --model)"
    )
    s.add_argument(
        "--peer-url",
        default="",
        help="also run the conversations against this OpenAI-compatible server (e.g. http://127.0.0.1:8000 of "
        "`vllm serve` on --model's checkpoint), everything over HTTP through one client; a 'peer' row",
    )
    s.add_argument("--peer-model", default="", help="the model name the peer serves (default: the first at /v1/models)")
    o = p.add_argument_group("output")
    o.add_argument("--out", default="himamba-bench-multiturn", help="folder for multiturn.json and multiturn.png")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def spec_from_args(args: argparse.Namespace) -> WorkloadSpec:
    for name in ("num_clients", "max_parallel", "request_length", "output_length", "num_rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.sub_question_input_length < 0:
        raise ValueError(f"--sub-question-input-length must be >= 0, got {args.sub_question_input_length}")
    return WorkloadSpec(
        num_clients=args.num_clients,
        num_rounds=args.num_rounds,
        request_length=args.request_length,
        sub_question_length=args.sub_question_input_length or args.request_length,
        output_length=args.output_length,
        seed=args.seed,
    )


def demo_model_dir(preset: str) -> Path:
    """The demo checkpoint of `preset` in the user's cache dir, built on first use."""
    from himamba.services.modelgen.checkpoint import make_checkpoint

    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "himamba"
    path = base / f"bench-{_DEMO_ARCH}-{preset}-seed0"
    if (path / "config.json").exists() and (path / "model.safetensors").exists():
        return path
    _log(f"building the demo {preset} checkpoint (random weights) in {path}")
    base.mkdir(parents=True, exist_ok=True)
    # Built aside and renamed, so an interrupted build never looks complete.
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=base))
    make_checkpoint(_DEMO_ARCH, tmp, preset=preset, seed=0)
    try:
        os.replace(tmp, path)
    except OSError:  # another run built it meanwhile
        pass
    return path


def storage_supported() -> bool:
    """Whether this server build has the storage tier flags (read from `himamba serve --help`)."""
    env = dict(os.environ, PYTHONSAFEPATH="1")
    out = subprocess.run(
        [*himamba_command(), "serve", "--help"], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    return _STORAGE_FLAG in out.stdout


def config_flags(name: str, storage_dir: Path, has_storage: bool) -> list[str]:
    """`himamba serve` flags of one configuration. Where the server has a storage tier it is
    switched off explicitly everywhere but `storage` (it may be on by default)."""
    off = [_STORAGE_FLAG, "none"] if has_storage else []
    if name == "none":
        return ["--disable-radix-cache", *off]
    if name == "device":
        return ["--no-enable-hierarchical-cache", *off]
    if name == "host":
        return off
    return [_STORAGE_FLAG, "file", "--hicache-storage-dir", str(storage_dir)]


async def _warm_up(turns: TurnClient, token_pool: Sequence[int]) -> None:
    """One short request first: the first forward of a fresh worker pays one-off costs."""
    rng = random.Random("warm-up")
    ids = [token_pool[rng.randrange(len(token_pool))] for _ in range(64)]
    async with turns:
        rec, _ = await turns.timed_request(Turn(client=-1, round=1, input_ids=ids, repeated_len=0), 4)
    if not rec.ok:
        raise RuntimeError(f"the warm-up request failed: {rec.error}")


def _run_rates(
    config: str,
    turns: Callable[[], TurnClient],
    args: argparse.Namespace,
    spec: WorkloadSpec,
    token_pool: Sequence[int],
    rates: Sequence[float],
) -> list[RunSummary]:
    """`turns` makes a fresh client per run (an HTTP session belongs to one event loop)."""
    asyncio.run(_warm_up(turns(), token_pool))
    rows = []
    for i, rate in enumerate(rates):
        # Fresh conversations per rate (nothing cached by an earlier rate can hit), the same
        # ones for every configuration at that rate.
        spec_i = dataclasses.replace(spec, seed=spec.seed + 1000 * i)
        rate_s = "inf" if math.isinf(rate) else f"{rate:g}"
        progress = Progress(spec_i.num_requests, f"{config} @ {rate_s} req/s", enabled=not args.no_progress)
        try:
            result = asyncio.run(
                run_multiturn(
                    turns(),
                    spec_i,
                    token_pool,
                    max_parallel=args.max_parallel,
                    arrivals=Arrivals(args.distribution, rate, spec_i.seed),
                    ready_policy=args.ready_queue_policy,
                    progress=progress,
                )
            )
        finally:
            progress.close()
        row = summarize(config, rate, result.records, result.duration_s)
        if row.num_failed:
            first = next(r.error for r in result.records if not r.ok)
            _log(f"{config} @ {rate_s}: {row.num_failed} request(s) failed; first: {first}")
        rows.append(row)
    return rows


def _flag_value(flags: Sequence[str], name: str, default: str) -> str:
    """The value of the last `name VALUE` / `name=VALUE` in a flag list (the one argparse keeps)."""
    value = default
    for i, f in enumerate(flags):
        if f == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif f.startswith(name + "="):
            value = f.split("=", 1)[1]
    return value


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        spec = spec_from_args(args)
        if args.endpoint and not args.model:
            raise ValueError("--endpoint needs --model (the checkpoint the server runs: its vocabulary is sampled)")
        if args.endpoint and args.peer_url:
            raise ValueError("--peer-url compares servers the bench starts, over HTTP; --endpoint is a ZeroMQ endpoint")
        if args.peer_url and not args.peer_url.startswith(("http://", "https://")):
            raise ValueError(f"--peer-url must be an http:// or https:// URL, got {args.peer_url!r}")
    except ValueError as e:
        print(f"himamba bench multiturn: {e}", file=sys.stderr)
        return 2
    rates = args.sweep or [args.request_rate]
    model_dir = Path(args.model).expanduser() if args.model else demo_model_dir(args.preset)
    if not (model_dir / "config.json").exists():
        print(f"himamba bench multiturn: --model {model_dir} is not a checkpoint (no config.json)", file=sys.stderr)
        return 2
    token_pool = ordinary_token_ids(model_dir)
    server_args = shlex.split(args.server_args)
    machine = describe_machine(args.torch_threads, args.device)
    # The dtype the server will run: `--dtype auto` resolved as the server resolves it.
    asked = ModelConfig(dtype=_flag_value(server_args, "--dtype", "auto"), device=args.device)  # type: ignore[arg-type]
    dtype = resolve_dtype(asked, json.loads((model_dir / "config.json").read_text())).dtype
    model = describe_model(model_dir, "" if args.model else args.preset, dtype)
    out_dir = Path(args.out)
    notes: list[str] = []
    skipped: dict[str, str] = {}
    context = spec.final_prompt_len + spec.output_length
    common = ["--torch-threads", str(args.torch_threads), "--device", args.device]
    if context > _SERVER_DEFAULT_CONTEXT:
        common += ["--max-context-len", str(context)]
    if model.max_position_embeddings and context > model.max_position_embeddings:
        notes.append(
            f"conversations reach {context} tokens, past the model's max_position_embeddings {model.max_position_embeddings}"
        )
    print(machine.line())
    print(model.line())
    print(
        f"workload: {spec.num_clients} clients x {spec.num_rounds} rounds, first message {spec.request_length} tokens, "
        f"later {spec.sub_question_length}, output {spec.output_length}; max parallel {args.max_parallel}, "
        f"{args.distribution} arrivals at {', '.join('inf' if math.isinf(r) else f'{r:g}' for r in rates)} req/s; "
        f"last prompt {spec.final_prompt_len} tokens; ideal cached ratio {spec.ideal_cached_ratio:.3f}",
        flush=True,
    )

    rows: list[RunSummary] = []
    configs = ["external"] if args.endpoint else list(args.configs)
    peer_model = ""
    if args.peer_url:
        try:
            peer_model = args.peer_model or served_model(args.peer_url.rstrip("/"))
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            print(
                f"himamba bench multiturn: --peer-url {args.peer_url}: no model listed at /v1/models ({e})",
                file=sys.stderr,
            )
            return 2
        _log(f"peer: {args.peer_url} serving {peer_model!r}")
    has_storage = not args.endpoint and storage_supported()
    if "storage" in configs and not has_storage:
        skipped["storage"] = f"this server has no {_STORAGE_FLAG} flag yet (storage tier not built)"
        configs.remove("storage")
        _log(f"skipping storage: {skipped['storage']}")
    with tempfile.TemporaryDirectory(prefix="himamba-bench-") as work:
        for config in configs:
            if config == "external":
                rows += _run_rates(config, functools.partial(ZmqTurns, args.endpoint), args, spec, token_pool, rates)
                continue
            flags = [*common, *config_flags(config, Path(work) / "storage", has_storage), *server_args]
            port = free_port() if args.peer_url else 0
            if port:
                flags += ["--port", str(port)]
            _log(f"{config}: starting a server (himamba serve {' '.join(flags)})")
            t0 = time.monotonic()
            server: ServerProcess | None = None
            try:
                server = start_server(model_dir, out_dir / "logs", *flags, ready_timeout_s=600)
                _log(f"{config}: ready in {time.monotonic() - t0:.0f}s")
                if port:
                    url = f"http://127.0.0.1:{port}"
                    ours = served_model(url)
                    rows += _run_rates(config, functools.partial(OpenAITurns, url, ours), args, spec, token_pool, rates)
                else:
                    zmq_turns = functools.partial(ZmqTurns, server.endpoint)
                    rows += _run_rates(config, zmq_turns, args, spec, token_pool, rates)
            except (RuntimeError, TimeoutError, OSError) as e:
                skipped[config] = f"server failed: {str(e)[-600:]}"
                _log(f"{config}: {skipped[config]}")
            finally:
                if server is not None:
                    server.stop()
        if args.peer_url:
            _log(f"{PEER}: {args.peer_url}")
            try:
                rows += _run_rates(
                    PEER, functools.partial(OpenAITurns, args.peer_url, peer_model), args, spec, token_pool, rates
                )
            except RuntimeError as e:
                skipped[PEER] = str(e)[-600:]
                _log(f"{PEER}: {skipped[PEER]}")

    add_ratios_vs_none(rows)
    print()
    print(format_tables(rows))
    goals = goal_lines(rows)
    for line in goals:
        print(line)
    comparison = peer_comparison(rows, PEER) if args.peer_url else []
    if comparison:
        print()
        print(peer_table(comparison, args.peer_url))
    limit = None
    limits: list[str] = []
    if args.device == "cpu":
        _log("measuring the limit of caching (the worker prefilling only a later turn's new tokens)")
        limit = measure_ttft_limit(model_dir, dtype, args.torch_threads, spec, LATE_ROUND)
        limits = limit_lines(rows, limit.seconds, limit.new_tokens)
    else:
        notes.append("the limit of caching is measured on CPU only (the bench's engine has no CUDA path)")
    for line in limits:
        print(line)
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    title = f"himamba bench multiturn\n{machine.line()}\n{model.line()}"
    outcome = plot(out_dir / "multiturn.png", rows, title)
    if not outcome.written:
        notes.append(outcome.note)
    for note in notes:
        print(f"note: {note}")
    payload: dict[str, Any] = {
        "benchmark": "multiturn",
        "machine": machine._asdict(),
        "model": model._asdict(),
        "workload": {
            **dataclasses.asdict(spec),
            "max_parallel": args.max_parallel,
            "distribution": args.distribution,
            "ready_queue_policy": args.ready_queue_policy,
            "request_rates": ["inf" if math.isinf(r) else r for r in rates],
            "final_prompt_len": spec.final_prompt_len,
            "ideal_cached_ratio": spec.ideal_cached_ratio,
        },
        "server_args": [*common, *server_args],
        "configs": {c: config_flags(c, Path("<tmp>/storage"), has_storage) for c in configs if c in CONFIGS},
        "skipped": skipped,
        "results": [r.to_json() for r in rows],
        "peer": {
            "url": args.peer_url,
            "model": peer_model,
            "client": "OpenAI /v1/completions over HTTP, streamed, for every row",
            "comparison": comparison,
        }
        if args.peer_url
        else None,
        "goal": goals,
        "ttft_limit": {**limit._asdict(), "lines": limits} if limit is not None else None,
        "plot": "multiturn.png" if outcome.written else None,
        "notes": notes,
    }
    write_json(out_dir / "multiturn.json", payload)
    print(f"wrote {out_dir / 'multiturn.json'}" + (f" and {out_dir / 'multiturn.png'}" if outcome.written else ""))
    failed = any(r.num_failed for r in rows) or any(k != "storage" for k in skipped)
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
