"""How `himamba bench cache` keeps its results: the printed lines, <out>/cache.json and <out>/cache.png."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from himamba.bench.machine_info import MachineInfo
from himamba.bench.report_files import PlotOutcome, no_matplotlib, open_pyplot, save_figure, write_json

_OPS = ("match", "insert", "evict", "backup", "load_back")
# The storage probe's bandwidths, as (result key, label, factor to MB/s).
_BANDWIDTHS = (
    ("storage_write_mb_s", "backend\nwrite", 1.0),
    ("storage_read_mb_s", "backend\nread", 1.0),
    ("storage_disk_write_fsync_mb_s", "disk write\n+fsync", 1.0),
    ("storage_disk_read_mb_s", "disk\nread", 1.0),
    ("storage_memcpy_gb_s", "memcpy", 1000.0),
)


class Transcript:
    """Prints lines to stdout and keeps them, so the JSON holds exactly what was printed."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        self.lines.append(line)


class WrittenReport(NamedTuple):
    """Where the files went; `plot.note` says why there is no PNG."""

    json_path: Path
    png_path: Path | None
    plot: PlotOutcome


def workload(args: argparse.Namespace) -> dict[str, Any]:
    """What the figures ran on instead of a model: the trace, the pools and the tiers."""
    return {
        "clients": args.clients,
        "turns": args.turns,
        "first": args.first,
        "each": args.each,
        "gen": args.gen,
        "page_size": args.page_size,
        "kv_frac": args.kv_frac,
        "mamba_slots": args.mamba_slots,
        "host_ratio": args.host_ratio,
        "policy": args.policy,
        "write_policy": args.write_policy,
        "tiers": list(args.tiers),
        "backend": args.backend if "storage" in args.tiers else None,
        "seed": args.seed,
        "repeat": args.repeat,
    }


def workload_line(w: dict[str, Any]) -> str:
    """The workload stated in one line, where a model bench states its model."""
    storage = f", storage backend {w['backend']}" if w["backend"] else ""
    return (
        f"workload: {w['clients']} clients x {w['turns']} turns, first prompt {w['first']} tokens, {w['each']} new "
        f"per later turn, {w['gen']} generated; page {w['page_size']}; tiers {','.join(w['tiers'])}{storage}; "
        f"no model (radix tree and allocators alone, one Python thread)"
    )


def plot(path: Path, result: dict[str, Any], pass_rps: Sequence[float], title: str) -> PlotOutcome:
    """Requests/s per pass, cached ratio per tier against the ideal, operation latencies and, when
    the storage tier was measured, its MB/s beside the machine's. Needs matplotlib (the `bench` extra)."""
    plt = open_pyplot()
    if plt is None:
        return no_matplotlib()
    has_storage = "storage_write_mb_s" in result
    fig, axes = plt.subplots(1, 4 if has_storage else 3, figsize=(16 if has_storage else 12, 4.4))
    ax_rps, ax_ratio, ax_ops = axes[:3]
    xs = list(range(len(pass_rps)))
    ax_rps.bar(xs, pass_rps, color="tab:blue")
    median = result["requests_per_s"]
    ax_rps.axhline(median, color="black", linestyle="--", label=f"median {median:,.0f}")
    ax_rps.set_xticks(xs, [f"pass {i + 1}" for i in xs])
    ax_rps.set_ylabel("requests/s")
    ax_rps.set_title(f"throughput ({result['policy']}, {result['write_policy']})")
    ax_rps.legend(fontsize=8)

    ax_ratio.bar([0], [result["device_ratio"]], 0.5, label="device", color="tab:green")
    ax_ratio.bar([0], [result["host_ratio"]], 0.5, bottom=[result["device_ratio"]], label="host", color="tab:orange")
    ax_ratio.bar([1], [result["ideal_ratio"]], 0.5, label="ideal", color="tab:gray")
    ax_ratio.set_xticks([0, 1], ["cached", "ideal"])
    ax_ratio.set_ylim(0, 1)
    ax_ratio.set_ylabel("share of prompt tokens")
    ax_ratio.set_title("cached-token ratio")
    ax_ratio.legend(fontsize=8)

    w = 0.38
    xs = list(range(len(_OPS)))
    ax_ops.bar([x - w / 2 for x in xs], [result[f"{op}_us_median"] for op in _OPS], w, label="median")
    ax_ops.bar([x + w / 2 for x in xs], [result[f"{op}_us_mean"] for op in _OPS], w, label="mean")
    ax_ops.set_xticks(xs, [op.replace("_", "-") for op in _OPS])
    ax_ops.set_ylabel("us per operation")
    ax_ops.set_title("operation latency")
    ax_ops.legend(fontsize=8)

    if has_storage:
        ax_bw = axes[3]
        got = [(label, result[key] * factor) for key, label, factor in _BANDWIDTHS if key in result]
        ax_bw.bar(range(len(got)), [v for _, v in got], color=["tab:purple"] * 2 + ["tab:gray"] * (len(got) - 2))
        ax_bw.set_xticks(range(len(got)), [label for label, _ in got], fontsize=8)
        ax_bw.set_yscale("log")
        ax_bw.set_ylabel("MB/s")
        ax_bw.set_title(f"storage ({result.get('storage_backend', '?')}) vs machine")
    for ax in axes:
        ax.grid(alpha=0.3, axis="y")
    return save_figure(plt, fig, path, title)


def write_report(
    out_dir: Path,
    machine: MachineInfo,
    work: dict[str, Any],
    lines: Sequence[str],
    result: dict[str, Any],
    pass_rps: Sequence[float],
) -> WrittenReport:
    """Writes cache.png (when it can) and cache.json: the machine, the workload, every printed
    line, the per-pass requests/s and the result object the bench prints last."""
    title = f"himamba bench cache\n{machine.line()}\n{workload_line(work)}"
    png = out_dir / "cache.png"
    outcome = plot(png, result, pass_rps, title)
    payload = {
        "benchmark": "cache",
        "machine": machine._asdict(),
        "workload": work,
        "printed": list(lines),
        "pass_requests_per_s": [round(r, 1) for r in pass_rps],
        "result": result,
        "plot": png.name if outcome.written else None,
        "notes": [] if outcome.written else [outcome.note],
    }
    json_path = out_dir / "cache.json"
    write_json(json_path, payload)
    return WrittenReport(json_path, png if outcome.written else None, outcome)
