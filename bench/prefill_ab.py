"""`himamba bench prefill-ab`: prefill step times of this build and another, side by side in one run.

A kernel change is judged against the commit before it, on the same machine, in the same hour: a VM's
speed drifts by more than most kernel changes gain. So each round starts one fresh process per build
(alternating which goes first) once the CPUs are quiet (`quiet_cpu.wait_quiet`; it says when they
were not), each times every case `--repeats` times after one warm-up step, and
the table gives each build's median (min) and quartiles over all rounds, and the other build's median
over this one's (>1: this build is faster).

The other build is named by its Python (`--against`, e.g. a worktree's venv whose `himamba` is the
commit before): this file runs in that interpreter by path, so its child half imports only what
every build since the varlen prefill has (`bench.forward`'s OurEngine and checkpoint_dir, the
loader, StepTimes, heap_reuse). Both builds load the same cached checkpoint and get the same prompts.

Cases: each `--prompt-lens` length as one prompt; each `--prefill-batches` PROMPTSxTOKENS as one step
of that many prompts, and again with two captures per prompt (offsets L/2 and 25L/32: a page boundary
and a point inside a chunk), "n/a" for a build whose step takes no captures. Each process sets
glibc's heap thresholds as the worker does (without them a long prompt's step pays page faults that
differ by process). Writes OUT/prefill_ab.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_CAPTURES = " with 2 captures each"


def _child(arch: str, preset: str, threads: int, repeats: int, cases: list[list[int]], out: str) -> None:
    """Time each case in this interpreter's build; write {case name: [seconds]} and where the build lives."""
    import torch

    from himamba.bench import forward
    from himamba.bench.step_times import StepTimes
    from himamba.services.worker.heap_reuse import reuse_heap
    from himamba.services.worker.loader import load_model

    heap = reuse_heap()
    torch.set_num_threads(threads)
    model = load_model(forward.checkpoint_dir(arch, preset, 0), device="cpu", dtype=torch.float32)
    most = max(len(c) for c in cases)
    eng = forward.OurEngine(model, 16, max_tokens=sum(max(cases, key=sum)) + 16 * most, max_seqs=3 * most + 1)
    takes_captures = hasattr(eng, "take_slot")
    spare = [eng.take_slot() for _ in range(2 * most)] if takes_captures else []
    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[float] | None] = {}
    for r in range(repeats + 1):
        for lens in cases:
            for captured in (False, True) if len(lens) > 1 else (False,):
                name = _case_name(lens) + (_CAPTURES if captured else "")
                if captured and not takes_captures:
                    times[name] = None
                    continue
                seqs = [eng.new_seq() for _ in lens]
                prompts = [torch.randint(1, model.vocab_size, (n,), generator=gen).tolist() for n in lens]
                kwargs = {}
                if captured:
                    kwargs["captures"] = [
                        [(n // 2, spare[2 * i]), (25 * n // 32, spare[2 * i + 1])] for i, n in enumerate(lens)
                    ]
                t0 = time.perf_counter()
                eng.step("prefill", seqs, prompts, StepTimes(), **kwargs)
                dt = time.perf_counter() - t0
                eng.release(seqs)
                if r > 0:
                    timed = times.setdefault(name, [])
                    assert timed is not None
                    timed.append(dt)
    where = str(Path(forward.__file__).resolve().parents[1])
    Path(out).write_text(json.dumps({"times": times, "build": where, "heap_reuse": heap.reason}))


def _case_name(lens: list[int]) -> str:
    return f"1 x {lens[0]}" if len(lens) == 1 else f"{len(lens)} x {lens[0]}"


def _commit(folder: str) -> str:
    """The short commit a build's folder is checked out at, "+changes" when its tracked files differ ("" when it is not
    a git checkout)."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", folder, *args], check=False, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return ""
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def _run_build(python: str, label: str, args: argparse.Namespace, cases: list[list[int]], out: Path) -> dict[str, Any]:
    cmd = [python, str(Path(__file__).resolve()), "--child", args.arch, args.preset, str(args.threads)]
    cmd += [str(args.repeats), json.dumps(cases), str(out)]
    env = {**os.environ, "PYTHONSAFEPATH": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-8:])
        raise RuntimeError(f"the {label} build ({python}) failed (exit {done.returncode}):\n{tail}")
    return json.loads(out.read_text())


def parse_args(argv: list[str]) -> argparse.Namespace:
    from himamba.bench.forward import batch_list, int_list

    p = argparse.ArgumentParser(prog="himamba bench prefill-ab", description=__doc__.split("\n")[0])
    p.add_argument("--against", required=True, help="the other build's Python (a venv whose himamba is that commit)")
    p.add_argument("--arch", default="nemotron_h")
    p.add_argument("--preset", default="medium")
    p.add_argument("--threads", type=int, default=0, help="torch threads in each process (0: torch's default)")
    p.add_argument("--prompt-lens", type=int_list, default=[512, 2048])
    p.add_argument("--prefill-batches", type=batch_list, default=[(8, 256)], help="as PROMPTSxTOKENS, e.g. 8x256")
    p.add_argument("--rounds", type=int, default=8, help="rounds of one fresh process per build")
    p.add_argument("--repeats", type=int, default=3, help="timed steps of each case per process (after one warm-up)")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=10.0,
        help="most seconds to wait for quiet CPUs before each process (0: none)",
    )
    p.add_argument("--out", type=Path, default=Path("bench-prefill-ab"))
    args = p.parse_args(argv)
    if args.rounds < 1 or args.repeats < 1:
        p.error("--rounds and --repeats must be at least 1")
    if not (Path(args.against).is_file() and os.access(args.against, os.X_OK)):
        p.error(f"--against {args.against}: no such executable")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        arch, preset, threads, repeats, cases, out = argv[1:7]
        _child(arch, preset, int(threads), int(repeats), json.loads(cases), out)
        return 0
    import statistics

    import torch

    from himamba.bench.forward import checkpoint_dir
    from himamba.bench.latency_summary import percentile
    from himamba.bench.machine_info import describe_machine
    from himamba.bench.quiet_cpu import wait_quiet
    from himamba.bench.report_files import write_json

    args = parse_args(argv)
    args.threads = args.threads or torch.get_num_threads()
    cases = [[n] for n in args.prompt_lens] + [[n] * b for b, n in args.prefill_batches]
    checkpoint_dir(args.arch, args.preset, 0)  # made once here, not raced by the first two processes
    builds = {"this": sys.executable, "against": args.against}
    times: dict[str, dict[str, list[float] | None]] = {"this": {}, "against": {}}
    where: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = list(builds) if r % 2 == 0 else list(reversed(builds))
            for label in order:
                waited = wait_quiet(limit_s=args.quiet_wait) if args.quiet_wait > 0 else None
                if waited is not None and waited.measured and not waited.quiet:
                    busy = f"{waited.busy_cores:.2f} CPUs still busy after {waited.waited_s:.0f} s"
                    print(f"timing anyway: {busy}", file=sys.stderr, flush=True)
                try:
                    got = _run_build(builds[label], label, args, cases, Path(tmp) / f"{label}-{r}.json")
                except RuntimeError as e:
                    print(f"himamba bench prefill-ab: {e}", file=sys.stderr)
                    return 1
                where[label] = got["build"]
                for name, ts in got["times"].items():  # None: a case this build cannot run
                    times[label][name] = None if ts is None else [*(times[label].get(name) or []), *ts]
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    names = {label: f"{label} ({_commit(where[label]) or where[label]})" for label in builds}
    machine = describe_machine(args.threads, "cpu").line()
    rows = []
    for case in times["this"]:
        row: dict[str, Any] = {"case": case}
        for label in builds:
            ts = times[label].get(case)
            row[label] = (
                None
                if not ts
                else {
                    "median_ms": statistics.median(ts) * 1e3,
                    "min_ms": min(ts) * 1e3,
                    "p25_ms": percentile(ts, 25) * 1e3,
                    "p75_ms": percentile(ts, 75) * 1e3,
                    "n": len(ts),
                }
            )
        row["against_over_this"] = (
            row["against"]["median_ms"] / row["this"]["median_ms"] if row["this"] and row["against"] else None
        )
        rows.append(row)
    print(machine)
    print(f"{args.arch} {args.preset}, float32, {args.threads} threads, {args.rounds} rounds x {args.repeats} steps")
    print(f"| Prefill step | {names['this']} | {names['against']} | against / this |")
    print("| --- | --- | --- | --- |")
    for row in rows:
        cells = [
            "n/a" if s is None else f"{s['median_ms']:.0f} ms ({s['min_ms']:.0f}), {s['p25_ms']:.0f}-{s['p75_ms']:.0f}"
            for s in (row["this"], row["against"])
        ]
        ratio = "" if row["against_over_this"] is None else f"{row['against_over_this']:.2f}x"
        print(f"| {row['case']} | {cells[0]} | {cells[1]} | {ratio} |")
    write_json(
        args.out / "prefill_ab.json",
        {
            "machine": machine,
            "arch": args.arch,
            "preset": args.preset,
            "threads": args.threads,
            "rounds": args.rounds,
            "repeats": args.repeats,
            "builds": names,
            "rows": rows,
        },
    )
    print(f"wrote {args.out / 'prefill_ab.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
