"""How `himamba bench multiturn` shows its results: two tables (three against a peer), a JSON file and
a PNG plot."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from himamba.bench.latency_summary import RunSummary
from himamba.bench.report_files import PlotOutcome, no_matplotlib, open_pyplot, save_figure


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _rate(r: float) -> str:
    return "inf" if math.isinf(r) else f"{r:g}"


def format_tables(rows: Sequence[RunSummary]) -> str:
    """A latency/throughput table and a cache table, one line per (configuration, rate)."""
    lat = [
        (
            f"{'config':<8} {'rate':>5} {'reqs':>5} {'fail':>4} {'ttft p50':>9} {'p90':>8} {'p99':>8} {'t3+ p50':>8} "
            f"{'itl p50':>8} {'p90':>7} {'e2e p50':>8} {'p90':>8} {'in tok/s':>9} {'out tok/s':>9}"
        )
    ]
    for r in rows:
        lat.append(
            f"{r.config:<8} {_rate(r.request_rate):>5} {r.num_requests:>5} {r.num_failed:>4} {_ms(r.ttft_p50_s):>9} "
            f"{_ms(r.ttft_p90_s):>8} {_ms(r.ttft_p99_s):>8} {_ms(r.late_ttft_p50_s):>8} {_ms(r.itl_p50_s):>8} "
            f"{_ms(r.itl_p90_s):>7} {_ms(r.e2e_p50_s):>8} {_ms(r.e2e_p90_s):>8} {r.input_tokens_per_s:>9.0f} "
            f"{r.output_tokens_per_s:>9.1f}"
        )
    cache = [
        (
            f"{'config':<8} {'rate':>5} {'device':>7} {'host':>6} {'storage':>7} {'cached':>7} {'ideal':>6} "
            f"{'of ideal':>8} | vs none: {'ttft p50':>8} {'t3+ ttft':>8} {'e2e p50':>8} {'out tok/s':>9}"
        )
    ]
    for r in rows:
        c, v = r.cached_ratio, r.ratios_vs_none
        of_ideal = "-" if r.cached_vs_ideal is None else f"{r.cached_vs_ideal:.1%}"
        cache.append(
            f"{r.config:<8} {_rate(r.request_rate):>5} {c['device']:>7.3f} {c['host']:>6.3f} {c['storage']:>7.3f} "
            f"{c['total']:>7.3f} {r.ideal_ratio:>6.3f} {of_ideal:>8} |          {_x(v.get('ttft_p50_speedup')):>8} "
            f"{_x(v.get('late_ttft_p50_speedup')):>8} {_x(v.get('e2e_p50_speedup')):>8} "
            f"{_x(v.get('output_tokens_throughput_gain')):>9}"
        )
    legend = (
        "times in ms; t3+ = requests of round 3 and later; cached = prompt tokens served from each tier / prompt tokens; "
        "ideal = share of prompt tokens that repeat the conversation; vs none: TTFT speedup (none / this), "
        "throughput gain (this / none)"
    )
    return "\n".join([*lat, "", *cache, legend])


_VERSUS = ("ttft_p50_s", "ttft_p99_s", "input_tokens_per_s", "output_tokens_per_s")


def peer_comparison(rows: Sequence[RunSummary], peer: str) -> list[dict[str, Any]]:
    """Each of our rows beside the peer's at the same request rate: the four figures of both, and
    the peer's TTFT over ours (above 1: ours answers first) and our throughput over the peer's."""
    theirs = {r.request_rate: r for r in rows if r.config == peer}
    out = []
    for row in rows:
        ref = theirs.get(row.request_rate)
        if row.config == peer or ref is None:
            continue
        entry: dict[str, Any] = {"config": row.config, "request_rate": _rate(row.request_rate)}
        for key in _VERSUS:
            entry[key] = getattr(row, key)
            entry[f"peer_{key}"] = getattr(ref, key)
        for key in ("ttft_p50_s", "ttft_p99_s"):
            mine, other = getattr(row, key), getattr(ref, key)
            entry[key.removesuffix("_s") + "_speedup"] = other / mine if mine and other else None
        for key in ("input_tokens_per_s", "output_tokens_per_s"):
            mine, other = getattr(row, key), getattr(ref, key)
            entry[key.removesuffix("_per_s") + "_throughput_gain"] = mine / other if other else None
        out.append(entry)
    return out


def _pair(entry: dict[str, Any], key: str, fmt: str, scale: float = 1.0) -> str:
    mine, other = (entry[key], entry[f"peer_{key}"])
    return " / ".join(f"{'-' if v is None else format(v * scale, fmt):>7}" for v in (mine, other))


def peer_table(comparison: Sequence[dict[str, Any]], peer_url: str) -> str:
    """The comparison as a table: ours / the peer's per figure, and the ratio."""
    head = (
        f"{'config':<8} {'rate':>5} | {'ttft p50 ms':>17} {'':>6} | {'ttft p99 ms':>17} {'':>6} | "
        f"{'in tok/s':>17} {'':>6} | {'out tok/s':>17} {'':>6}"
    )
    lines = [f"ours vs the peer at {peer_url} (same conversations, same HTTP client)", head]
    for e in comparison:
        lines.append(
            f"{e['config']:<8} {e['request_rate']:>5} | {_pair(e, 'ttft_p50_s', '.1f', 1000)} "
            f"{_x(e['ttft_p50_speedup']):>6} | {_pair(e, 'ttft_p99_s', '.1f', 1000)} {_x(e['ttft_p99_speedup']):>6} | "
            f"{_pair(e, 'input_tokens_per_s', '.0f')} {_x(e['input_tokens_throughput_gain']):>6} | "
            f"{_pair(e, 'output_tokens_per_s', '.1f')} {_x(e['output_tokens_throughput_gain']):>6}"
        )
    lines.append("ours / peer; TTFT ratio = peer / ours, throughput ratio = ours / peer (above 1.00x: ours is ahead)")
    return "\n".join(lines)


def goal_lines(rows: Sequence[RunSummary], min_context: int = 2048) -> list[str]:
    """The issue's goal, row by row: turn-3+ TTFT p50 >= 5x lower than `none`, cached >= 95% of ideal."""
    out = []
    for r in rows:
        if r.config == "none":
            continue
        speed = r.ratios_vs_none.get("late_ttft_p50_speedup")
        of_ideal = r.cached_vs_ideal
        ok_speed = speed is not None and speed >= 5
        ok_ratio = of_ideal is not None and of_ideal >= 0.95
        long_enough = r.max_prompt_tokens > min_context
        speed_text = (
            "no `none` row to compare with"
            if speed is None
            else f"t3+ TTFT p50 {_x(speed)} lower than none ({'met' if ok_speed else 'NOT met'}, >= 5x)"
        )
        ratio_text = "-" if of_ideal is None else f"{of_ideal:.1%}"
        out.append(
            f"goal {r.config} @ {_rate(r.request_rate)}: {speed_text}; cached {ratio_text} of ideal "
            f"({'met' if ok_ratio else 'NOT met'}, >= 95%); conversations reach {r.max_prompt_tokens} tokens"
            + ("" if long_enough else f" (the goal asks for > {min_context})")
        )
    return out


def limit_lines(rows: Sequence[RunSummary], limit_s: float, new_tokens: int) -> list[str]:
    """Later-turn TTFT against the limit of caching (the worker prefilling only a turn's new
    tokens), per configuration; the goal is <= 1.25x."""
    out = [f"limit of caching: the worker prefills a later turn's {new_tokens} new tokens in {limit_s * 1e3:.1f} ms"]
    for r in rows:
        if r.late_ttft_p50_s is None:
            continue
        ratio = r.late_ttft_p50_s / limit_s
        verdict = "met" if ratio <= 1.25 else "NOT met"
        out.append(
            f"{r.config} @ {_rate(r.request_rate)}: t3+ TTFT p50 {r.late_ttft_p50_s * 1e3:.1f} ms = {ratio:.2f}x the limit "
            f"({verdict}, <= 1.25x)"
        )
    return out


def plot(path: Path, rows: Sequence[RunSummary], title: str) -> PlotOutcome:
    """TTFT and throughput per configuration: against the request rate when several rates were
    run (a sweep), else as bars. Needs matplotlib (the `bench` extra)."""
    plt = open_pyplot()
    if plt is None:
        return no_matplotlib()
    configs = list(dict.fromkeys(r.config for r in rows))
    rates = sorted({r.request_rate for r in rows})
    fig, (ax_ttft, ax_tput) = plt.subplots(1, 2, figsize=(12, 4.8))
    if len(rates) > 1:
        finite = [x for x in rates if not math.isinf(x)]
        # a closed-loop point (rate inf) is drawn just right of the highest finite rate
        inf_at = (max(finite) * 1.5) if finite else 1.0
        for cfg in configs:
            mine = sorted((r for r in rows if r.config == cfg), key=lambda r: r.request_rate)
            xs = [inf_at if math.isinf(r.request_rate) else r.request_rate for r in mine]
            line = ax_ttft.plot(xs, [_ms_or_nan(r.ttft_p50_s) for r in mine], marker="o", label=f"{cfg} TTFT p50")
            ax_ttft.plot(
                xs, [_ms_or_nan(r.late_ttft_p50_s) for r in mine], marker="x", linestyle="--",
                color=line[0].get_color(), label=f"{cfg} turn 3+ p50",
            )  # fmt: skip
            ax_tput.plot(xs, [r.output_tokens_per_s for r in mine], marker="o", label=cfg)
        for ax in (ax_ttft, ax_tput):
            ax.set_xlabel("request rate (req/s)")
            if any(math.isinf(x) for x in rates):
                ax.set_xticks([*finite, inf_at], [*(f"{x:g}" for x in finite), "inf\n(closed loop)"])
        ax_ttft.set_yscale("log")
    else:
        xs = list(range(len(configs)))
        by = {r.config: r for r in rows}
        w = 0.38
        ax_ttft.bar([x - w / 2 for x in xs], [_ms_or_nan(by[c].ttft_p50_s) for c in configs], w, label="TTFT p50")
        ax_ttft.bar(
            [x + w / 2 for x in xs], [_ms_or_nan(by[c].late_ttft_p50_s) for c in configs], w, label="turn 3+ p50"
        )
        ax_tput.bar([x - w / 2 for x in xs], [by[c].output_tokens_per_s for c in configs], w, label="output")
        ax_tput.bar([x + w / 2 for x in xs], [by[c].input_tokens_per_s / 100 for c in configs], w, label="input / 100")
        for ax in (ax_ttft, ax_tput):
            ax.set_xticks(xs, configs)
            ax.set_xlabel(f"cache configuration (request rate {_rate(rates[0])})")
    ax_ttft.set_ylabel("TTFT (ms)")
    ax_tput.set_ylabel("tokens/s")
    ax_ttft.set_title("time to first token")
    ax_tput.set_title("throughput")
    for ax in (ax_ttft, ax_tput):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(plt, fig, path, title)


def _ms_or_nan(v: float | None) -> float:
    return math.nan if v is None else v * 1000
