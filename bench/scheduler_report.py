"""How `himamba bench scheduler` shows its results: a table, <out>/scheduler.json and <out>/scheduler.png."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from himamba.bench.report_files import PlotOutcome, no_matplotlib, open_pyplot, save_figure


class StrategyRow(NamedTuple):
    """One track strategy's figures: the flood's peaks and the multi-turn cached ratio."""

    strategy: str
    peak_running: int
    peak_held_slots: int  # state slots owned by running requests (working + track + checkpoints)
    slots_per_running: float  # at steady decode: the median over samples taken at peak concurrency
    flood_tokens_per_s: float
    cached_ratio: float
    ideal_ratio: float
    invariants_ok: bool


class Comparison(NamedTuple):
    """extra_buffer_lazy's peak concurrency over extra_buffer's; None without both rows."""

    lazy_vs_extra_concurrency: float | None


def compare(rows: Sequence[StrategyRow]) -> Comparison:
    """extra_buffer_lazy against extra_buffer, where both ran."""
    by = {r.strategy: r for r in rows}
    if "extra_buffer" not in by or "extra_buffer_lazy" not in by:
        return Comparison(None)
    return Comparison(round(by["extra_buffer_lazy"].peak_running / max(by["extra_buffer"].peak_running, 1), 2))


def format_table(rows: Sequence[StrategyRow], comparison: Comparison) -> list[str]:
    """One line per strategy, then the lazy/extra concurrency ratio when both ran."""
    lines = [
        f"{'strategy':<18} {'peak running':>12} {'held slots':>10} {'slots/req':>9} {'tok/s':>8} {'cached':>7} "
        f"{'ideal':>6}"
    ]
    for r in rows:
        lines.append(
            f"{r.strategy:<18} {r.peak_running:>12} {r.peak_held_slots:>10} {r.slots_per_running:>9} "
            f"{r.flood_tokens_per_s:>8} {r.cached_ratio:>7} {r.ideal_ratio:>6}"
        )
    if comparison.lazy_vs_extra_concurrency is not None:
        lines.append(
            f"lazy / extra_buffer peak concurrency: {comparison.lazy_vs_extra_concurrency:.2f}x "
            "(3 slots per request vs 2: at most 1.5x)"
        )
    return lines


def summary_line(rows: Sequence[StrategyRow], comparison: Comparison) -> dict[str, Any]:
    """The JSON object printed last (its shape predates the files: rows, then the ratio)."""
    summary: dict[str, Any] = {"rows": [r._asdict() for r in rows]}
    if comparison.lazy_vs_extra_concurrency is not None:
        summary["lazy_over_extra"] = comparison.lazy_vs_extra_concurrency
    return summary


def plot(path: Path, rows: Sequence[StrategyRow], title: str) -> PlotOutcome:
    """Peak running requests, state slots per request and the cached ratio (against the ideal),
    one bar per strategy. Needs matplotlib (the `bench` extra)."""
    plt = open_pyplot()
    if plt is None:
        return no_matplotlib()
    names = [r.strategy for r in rows]
    xs = list(range(len(rows)))
    fig, (ax_run, ax_slots, ax_cached) = plt.subplots(1, 3, figsize=(13, 4.6))
    ax_run.bar(xs, [r.peak_running for r in rows], color="tab:blue")
    ax_run.set_ylabel("requests")
    ax_run.set_title("peak running requests (fixed state pool)")
    ax_slots.bar(xs, [r.slots_per_running for r in rows], color="tab:orange")
    ax_slots.set_ylabel("state slots")
    ax_slots.set_title("state slots held per running request")
    w = 0.38
    ax_cached.bar([x - w / 2 for x in xs], [r.cached_ratio for r in rows], w, label="cached", color="tab:green")
    ax_cached.bar([x + w / 2 for x in xs], [r.ideal_ratio for r in rows], w, label="ideal", color="tab:gray")
    ax_cached.set_ylim(0, 1)
    ax_cached.set_ylabel("share of prompt tokens")
    ax_cached.set_title("multi-turn cached ratio")
    ax_cached.legend(fontsize=8)
    for ax in (ax_run, ax_slots, ax_cached):
        ax.set_xticks(xs, names, fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    return save_figure(plt, fig, path, title)
