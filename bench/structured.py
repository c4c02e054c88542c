"""`himamba bench structured`: what structured outputs cost in decode throughput.

One server; for each batch size (default 1 and 8), B concurrent requests of the same prompt
length each decode exactly `--gen` tokens, unconstrained and then under each grammar (a JSON
schema: an array of 10-field records; a regex of words; neither can finish within the budget),
greedy. Each case runs once to warm up
(the grammar is built and its lexer warmed), then `--repeats` times, the cases interleaved; the median run gives
decode tok/s (prefill included, the same in every case) and the ratio to unconstrained. Then,
in this process, what a constrained step adds in the worker (median microseconds per step to
compute the masks, apply them, feed the sampled tokens back): the end-to-end ratio on a busy
machine is noisy, this is the cost itself. Prints a table; the last line is one JSON object.
Writes <out>/structured.json (the machine, the model, the workload and everything printed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from himamba.bench.machine_info import describe_machine
from himamba.bench.model_info import describe_model
from himamba.bench.report_files import write_json
from himamba.bench.servers import start_server
from himamba.common.client import AsyncClient
from himamba.common.types import GrammarSpec, SamplingParams

_TORCH_THREADS = 1  # start_server's default, stated on the machine line
_S = {"type": "string", "maxLength": 16}
RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "name": _S,
        "email": _S,
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "city": _S,
        "created": _S,
        "note": {"anyOf": [_S, {"type": "null"}]},
    },
    "required": ["id", "name", "email", "active", "role", "score", "tags", "city", "created", "note"],
    "additionalProperties": False,
}
# Neither can end within any budget here (at least 1000 records; at least 1000 words), so every
# run decodes exactly its budget, as the unconstrained one (greedy, ignore_eos) does.
GRAMMARS: dict[str, GrammarSpec | None] = {
    "unconstrained": None,
    "json_schema": GrammarSpec(
        kind="json_schema", spec=json.dumps({"type": "array", "items": RECORD, "minItems": 1000})
    ),
    "regex": GrammarSpec(kind="regex", spec="([a-z]{1,8} ){1000,}"),
}


def _log(msg: str) -> None:
    print(f"[bench structured] {msg}", file=sys.stderr, flush=True)


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, vocab) for _ in range(n)]


async def _batch(endpoint: str, batch: int, prompt_len: int, gen: int, vocab: int, grammar: GrammarSpec | None,
                 seed: int) -> tuple[float, int]:  # fmt: skip
    """Wall seconds for `batch` concurrent requests decoding `gen` tokens each, and the tokens."""
    async with AsyncClient(endpoint) as c:
        t0 = time.perf_counter()
        outs = await asyncio.gather(
            *(c.generate(input_ids=_prompt(prompt_len, seed * 100 + i, vocab), max_tokens=gen, temperature=0,
                         grammar=grammar, ignore_eos=grammar is None)
              for i in range(batch))
        )  # fmt: skip
        wall = time.perf_counter() - t0
    for o in outs:
        if len(o.token_ids) != gen:
            raise RuntimeError(f"a run ended after {len(o.token_ids)} of {gen} tokens ({o.finish_reason})")
    return wall, sum(len(o.token_ids) for o in outs)


def worker_side_us(tokenizer_json: Path, vocab: int, eos: list[int], grammar: GrammarSpec, batch: int,
                   steps: int) -> dict[str, float]:  # fmt: skip
    """What a constrained step adds in the worker, measured in this process on the same code:
    median microseconds per step to compute the batch's masks, apply them to the logits, and
    feed each sampled token back to its matcher (greedy over random logits)."""
    import torch

    from himamba.services.worker.grammar_masks import GrammarCompiler
    from himamba.services.worker.sampler import sample

    compiler = GrammarCompiler(tokenizer_json, vocab, eos)
    try:
        states = [compiler.state(grammar, num_prompt=1) for _ in range(batch)]
        for g in states:
            g.feed(0, torch.tensor([1]))
        gen = torch.Generator().manual_seed(0)
        params = [SamplingParams()] * batch
        mask_us, apply_us, feed_us = [], [], []
        for step in range(steps):
            logits = torch.randn(batch, vocab, generator=gen)
            t0 = time.perf_counter()
            masks = compiler.masks(states, vocab)
            t1 = time.perf_counter()
            assert masks is not None
            masks.apply(logits)
            t2 = time.perf_counter()
            tokens = sample(logits, params, [step] * batch).tokens
            t3 = time.perf_counter()
            for g, t in zip(states, tokens):
                g.feed(1 + step, torch.tensor([t]))
            t4 = time.perf_counter()
            if any(g.error for g in states):
                raise RuntimeError(f"a matcher failed: {next(g.error for g in states if g.error)}")
            mask_us.append((t1 - t0) * 1e6)
            apply_us.append((t2 - t1) * 1e6)
            feed_us.append((t4 - t3) * 1e6)
    finally:
        compiler.close()
    med = statistics.median
    return {"mask_us": round(med(mask_us), 1), "apply_us": round(med(apply_us), 1), "feed_us": round(med(feed_us), 1),
            "total_us": round(med(mask_us) + med(apply_us) + med(feed_us), 1)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Entry point of `himamba bench structured`; returns the exit status."""
    p = argparse.ArgumentParser(prog="himamba bench structured", description=__doc__)
    p.add_argument("--model", default="", help="checkpoint dir (default: a tiny random NemotronH built in a temp dir)")
    p.add_argument("--batches", default="1,8", help="concurrent requests per case")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gen", type=int, default=128, help="tokens each request decodes")
    p.add_argument("--repeats", type=int, default=5, help="measured runs per case (after one warm-up)")
    p.add_argument("--grammars", default=",".join(GRAMMARS), help=f"cases, from {','.join(GRAMMARS)}")
    p.add_argument("--out", default="himamba-bench-structured", help="folder for structured.json")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    names = [g.strip() for g in args.grammars.split(",") if g.strip()]
    unknown = [g for g in names if g not in GRAMMARS]
    if unknown or not batches or not names:
        p.error(f"unknown grammar case(s) {unknown}; choose from {','.join(GRAMMARS)}")
    with tempfile.TemporaryDirectory(prefix="himamba-bench-") as tmp:
        return _run(args, batches, names, Path(tmp))


def _run(args: argparse.Namespace, batches: list[int], names: list[str], work: Path) -> int:
    model = args.model
    if not model:
        from himamba.services.modelgen.checkpoint import make_checkpoint

        _log("building a tiny random-weight NemotronH checkpoint")
        model = str(make_checkpoint("nemotron_h", work / "model", preset="tiny"))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    machine = describe_machine(_TORCH_THREADS, "cpu")
    model_info = describe_model(model, "" if args.model else "tiny", "float32")
    printed = [
        machine.line(),
        model_info.line(),
        (
            f"workload: batches {batches}, prompt {args.prompt_len} tokens, {args.gen} decoded tokens per request, "
            f"greedy, median of {args.repeats} runs after a warm-up"
        ),
        f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (a loaded machine's figures are noisy)",
    ]
    for line in printed:
        print(line, flush=True)
    _log("starting a server")
    server = start_server(model, work / "logs", "--max-running-requests", str(max(batches)))
    rows: list[dict[str, Any]] = []
    try:
        for batch in batches:
            for name in names:  # warm-up: grammars built, lexers warmed
                _log(f"batch {batch}, {name}: warm-up")
                asyncio.run(_batch(server.endpoint, batch, args.prompt_len, args.gen, vocab, GRAMMARS[name], 0))
            # Cases interleaved run by run, so a change in the machine's load hits them alike.
            runs: dict[str, list[tuple[float, int]]] = {name: [] for name in names}
            for r in range(args.repeats):
                _log(f"batch {batch}: run {r + 1} of {args.repeats}")
                for name in names:
                    got = _batch(server.endpoint, batch, args.prompt_len, args.gen, vocab, GRAMMARS[name], r + 1)
                    runs[name].append(asyncio.run(got))
            for name in names:
                rates = sorted((tokens / wall, wall, tokens) for wall, tokens in runs[name])
                rate, wall, tokens = rates[len(rates) // 2]  # the median run
                rows.append({
                    "batch": batch, "grammar": name, "wall_s": round(wall, 4), "tokens": tokens,
                    "tokens_per_s": round(rate, 1), "ms_per_token_per_seq": round(batch * 1000 / rate, 2),
                })  # fmt: skip
    finally:
        server.stop()
    eos = [0]
    try:
        eos = json.loads((Path(model) / "config.json").read_text()).get("eos_token_id", 0)
        eos = [eos] if isinstance(eos, int) else list(eos)
    except (OSError, ValueError):
        pass
    for r in rows:
        grammar = GRAMMARS[r["grammar"]]
        if grammar is not None:
            _log(f"batch {r['batch']}, {r['grammar']}: worker-side cost in this process")
            r["worker_side"] = worker_side_us(Path(model) / "tokenizer.json", vocab, eos, grammar, r["batch"], args.gen)
    base = {r["batch"]: r["tokens_per_s"] for r in rows if r["grammar"] == "unconstrained"}
    for r in rows:
        r["vs_unconstrained"] = round(r["tokens_per_s"] / base[r["batch"]], 3) if r["batch"] in base else None
    table = [
        (
            f"{'batch':>5}  {'grammar':<14} {'tokens':>7} {'tok/s':>9} {'ms/step':>8} {'vs unconstrained':>17}"
            f" {'worker us/step: mask':>21} {'apply':>6} {'feed':>6}"
        )
    ]
    for r in rows:
        ratio = f"{r['vs_unconstrained']:.3f}x" if r["vs_unconstrained"] is not None else "-"
        w = r.get("worker_side")
        side = (
            f" {w['mask_us']:>21.0f} {w['apply_us']:>6.0f} {w['feed_us']:>6.0f}"
            if w
            else f" {'-':>21} {'-':>6} {'-':>6}"
        )
        table.append(
            f"{r['batch']:>5}  {r['grammar']:<14} {r['tokens']:>7} {r['tokens_per_s']:>9.1f} "
            f"{r['ms_per_token_per_seq']:>8.2f} {ratio:>17}{side}"
        )
    table.append(f"load average at end: {os.getloadavg()[0]:.1f}")
    for line in table:
        print(line)
    summary = {"benchmark": "structured", "rows": rows}
    payload: dict[str, Any] = {
        "benchmark": "structured",
        "machine": machine._asdict(),
        "model": model_info._asdict(),
        "workload": {
            "batches": batches,
            "prompt_len": args.prompt_len,
            "gen": args.gen,
            "repeats": args.repeats,
            "grammars": {n: (None if GRAMMARS[n] is None else GRAMMARS[n].kind) for n in names},
        },
        "printed": [*printed, *table],
        "results": rows,
    }
    write_json(Path(args.out) / "structured.json", payload)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
