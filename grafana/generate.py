"""Build grafana/himamba.json from the metric definitions in himamba.common.metrics.

    python grafana/generate.py            # rewrite grafana/himamba.json
    python grafana/generate.py --check    # exit 1 if the committed file is out of date

Every PromQL expression is assembled from the `MetricDef`s themselves, so a renamed metric
changes the dashboard with it (tests/metrics checks the committed JSON is current and that
every expression names only metrics the server exports).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

from himamba.common import metrics as m
from himamba.common.metrics import MetricDef

OUT = Path(__file__).resolve().parent / "himamba.json"
RATE = "$__rate_interval"
QUANTILES = (0.5, 0.9, 0.99)


class Target(NamedTuple):
    expr: str
    legend: str


class Panel(NamedTuple):
    title: str
    targets: tuple[Target, ...]
    unit: str
    description: str = ""


DECODE = 'mode="decode"'


def _sel(defn: MetricDef, suffix: str = "", extra: str = "") -> str:
    name = defn.name + suffix
    assert name in defn.sample_names, name
    matchers = 'instance=~"$instance", model_name=~"$model_name"' + (f", {extra}" if extra else "")
    return f"{name}{{{matchers}}}"


def _rate(defn: MetricDef, suffix: str = "", by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({_sel(defn, suffix)}[{RATE}]))"


def _quantiles(defn: MetricDef, by: str = "") -> tuple[Target, ...]:
    keep = f"le, {by}" if by else "le"
    legend_by = f" {{{{{by}}}}}" if by else ""
    return tuple(
        Target(
            f"histogram_quantile({q}, sum by ({keep}) (rate({_sel(defn, '_bucket')}[{RATE}])))",
            f"p{int(q * 100)}{legend_by}",
        )
        for q in QUANTILES
    )


def _occupancy(part: MetricDef) -> Target:
    return Target(
        f"sum by (tier, kind) ({_sel(part)}) / sum by (tier, kind) ({_sel(m.POOL_CAPACITY_BYTES)} > 0)",
        "{{tier}} {{kind}}",
    )


def _hit_rate(hits: MetricDef) -> Target:
    # Token-weighted: every prompt token counts once, whatever the batch it arrived in.
    return Target(
        f"{_rate(hits, by='tier')} / ignoring(tier) group_left {_rate(m.CACHE_QUERY_TOKENS)}",
        "{{tier}}",
    )


ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    (
        "Requests",
        (
            Panel(
                "Running and waiting requests",
                (
                    Target(f"sum({_sel(m.SCHEDULER_RUNNING)})", "running"),
                    Target(f"sum({_sel(m.SCHEDULER_WAITING)})", "waiting"),
                ),
                "short",
            ),
            Panel(
                "Token throughput",
                (
                    Target(_rate(m.REQUEST_PROMPT_TOKENS), "prompt"),
                    Target(_rate(m.REQUEST_GENERATION_TOKENS), "generation"),
                ),
                "tps",
                "Tokens per second of finished requests.",
            ),
            Panel(
                "Finished requests by reason", (Target(_rate(m.REQUEST_FINISHED, by="reason"), "{{reason}}"),), "reqps"
            ),
            Panel(
                "HTTP responses by route and status",
                (Target(_rate(m.HTTP_RESPONSES, by="route, status"), "{{route}} {{status}}"),),
                "reqps",
            ),
        ),
    ),
    (
        "Latency",
        (
            Panel("Time to first token", _quantiles(m.REQUEST_TTFT), "s"),
            Panel("Inter-token latency", _quantiles(m.REQUEST_ITL), "s"),
            Panel("End-to-end request latency", _quantiles(m.REQUEST_E2E), "s"),
            Panel("Queue time", _quantiles(m.SCHEDULER_QUEUE_TIME), "s"),
            Panel("Worker step time", _quantiles(m.WORKER_STEP_TIME, by="mode"), "s"),
            Panel("Worker tokens per second", (Target(_rate(m.WORKER_STEP_TOKENS, by="mode"), "{{mode}}"),), "tps"),
            Panel(
                "Decode steps sent ahead (share)",
                (
                    Target(
                        f"{_rate(m.SCHEDULER_DECODE_STEPS_AHEAD)} / "
                        f"sum (rate({_sel(m.WORKER_STEP_TIME, '_count', DECODE)}[{RATE}]))",
                        "sent ahead",
                    ),
                ),
                "percentunit",
            ),
        ),
    ),
    (
        "Prefix cache",
        (
            Panel(
                "Hit rate per tier (token-weighted)",
                (_hit_rate(m.CACHE_HIT_TOKENS),),
                "percentunit",
                "rate(hit tokens) / rate(query tokens): share of looked-up prompt tokens each tier served.",
            ),
            Panel(
                "KV match rate per tier (token-weighted)",
                (_hit_rate(m.CACHE_KV_HIT_TOKENS),),
                "percentunit",
                "KV pages matched, with or without a cached recurrent state; above the hit rate when states are missing.",
            ),
            Panel(
                "Mamba state hits per tier",
                (Target(_rate(m.CACHE_MAMBA_STATE_HITS, by="tier"), "{{tier}}"),),
                "ops",
            ),
            Panel(
                "Cached prompt tokens per tier (from usage)",
                (Target(_rate(m.REQUEST_CACHED_TOKENS, by="tier"), "{{tier}}"),),
                "tps",
            ),
        ),
    ),
    (
        "Pools",
        (
            Panel("Pool occupancy (used / capacity)", (_occupancy(m.POOL_USED_BYTES),), "percentunit"),
            Panel("Protected share (locked / capacity)", (_occupancy(m.POOL_PROTECTED_BYTES),), "percentunit"),
            Panel("Evictable share (cache only / capacity)", (_occupancy(m.POOL_EVICTABLE_BYTES),), "percentunit"),
            Panel(
                "Pool capacity",
                (Target(f"sum by (tier, kind) ({_sel(m.POOL_CAPACITY_BYTES)})", "{{tier}} {{kind}}"),),
                "bytes",
                "Storage KV and states share one cap: each kind's line is what it holds plus the shared free part,"
                " so the storage lines do not add up.",
            ),
            Panel(
                "Mamba track slots in use",
                (Target(f"sum by (strategy) ({_sel(m.SCHEDULER_MAMBA_TRACK_SLOTS)})", "{{strategy}}"),),
                "short",
            ),
        ),
    ),
    (
        "Transfers and evictions",
        (
            Panel(
                "Transfer throughput",
                (
                    Target(_rate(m.CACHE_BACKUP_BYTES, by="tier, kind"), "backup to {{tier}} {{kind}}"),
                    Target(_rate(m.CACHE_PREFETCH_BYTES, by="tier, kind"), "prefetch from {{tier}} {{kind}}"),
                ),
                "Bps",
            ),
            Panel(
                "Transfer operations",
                (
                    Target(_rate(m.CACHE_BACKUP_OPS, by="tier"), "backup to {{tier}}"),
                    Target(_rate(m.CACHE_PREFETCH_OPS, by="tier"), "prefetch from {{tier}}"),
                ),
                "ops",
            ),
            Panel(
                "Transfers in flight",
                (Target(f"sum by (tier) ({_sel(m.CACHE_TRANSFERS_IN_FLIGHT)})", "{{tier}}"),),
                "short",
            ),
            Panel(
                "Storage reachable (1 up, 0 away)",
                (Target(f"min by (instance) ({_sel(m.CACHE_STORAGE_UP)})", "{{instance}}"),),
                "short",
            ),
            Panel(
                "Evictions",
                (Target(_rate(m.CACHE_EVICTED_BYTES, by="tier, kind"), "{{tier}} {{kind}}"),),
                "Bps",
            ),
            Panel(
                "Trouble: truncations, failures, errors, retractions",
                (
                    Target(_rate(m.CACHE_PREFETCH_TRUNCATIONS), "prefetch truncations"),
                    Target(_rate(m.SCHEDULER_LAZY_ALLOC_FAILURES), "lazy alloc failures"),
                    Target(_rate(m.CACHE_STORAGE_ERRORS, by="op"), "storage errors ({{op}})"),
                    Target(_rate(m.CACHE_STORAGE_EVENTS, by="event"), "storage {{event}}"),
                    Target(_rate(m.SCHEDULER_RETRACTIONS), "retractions"),
                ),
                "ops",
            ),
        ),
    ),
    (
        "Processes",
        (
            Panel(
                "Resident memory per service",
                (Target(f"sum by (service) ({_sel(m.PROCESS_RESIDENT_MEMORY)})", "{{service}}"),),
                "bytes",
                "Each of the four processes of a server measures itself; the worker holds the model.",
            ),
            Panel(
                "CPU per service",
                (Target(_rate(m.PROCESS_CPU, by="service"), "{{service}}"),),
                "percentunit",
                "CPU seconds per second (1 = one core busy).",
            ),
            Panel(
                "Open file descriptors per service",
                (Target(f"sum by (service) ({_sel(m.PROCESS_OPEN_FDS)})", "{{service}}"),),
                "short",
            ),
            Panel(
                "Running servers by version and dtype",
                (
                    Target(
                        f"count by (version, dtype, device) ({_sel(m.BUILD_INFO)})",
                        "{{version}} {{dtype}} {{device}}",
                    ),
                ),
                "short",
                "himamba_build_info: one series per server, its settings as labels.",
            ),
        ),
    ),
)


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit, "min": 0}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "expr": t.expr,
                "legendFormat": t.legend,
            }
            for i, t in enumerate(panel.targets)
        ],
    }


def build_dashboard() -> dict[str, Any]:
    """The dashboard as a JSON-ready dict (deterministic: same definitions, same output)."""
    panels: list[dict[str, Any]] = []
    next_id = 1
    y = 0
    for title, row_panels in ROWS:
        panels.append(
            {
                "id": next_id,
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        next_id += 1
        y += 1
        for i, panel in enumerate(row_panels):
            panels.append(_panel_json(panel, next_id, 12 * (i % 2), y + 8 * (i // 2)))
            next_id += 1
        y += 8 * ((len(row_panels) + 1) // 2)
    return {
        "uid": "himamba",
        "title": "himamba",
        "description": "Generated by grafana/generate.py from himamba.common.metrics; do not edit by hand.",
        "tags": ["himamba"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                {
                    "name": "model_name",
                    "label": "Model",
                    "type": "query",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": {"query": f"label_values({m.BUILD_INFO.name}, model_name)", "refId": "model_name"},
                    "definition": f"label_values({m.BUILD_INFO.name}, model_name)",
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {"text": "All", "value": "$__all"},
                    "refresh": 2,
                    "hide": 0,
                },
                {
                    "name": "instance",
                    "label": "Server",
                    "type": "query",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": {"query": f"label_values({m.SCHEDULER_RUNNING.name}, instance)", "refId": "instance"},
                    "definition": f"label_values({m.SCHEDULER_RUNNING.name}, instance)",
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {"text": "All", "value": "$__all"},
                    "refresh": 2,
                    "hide": 0,
                },
            ]
        },
        "panels": panels,
    }


def expressions(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the dashboard's panels."""
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def variable_queries(dashboard: dict[str, Any]) -> list[str]:
    """The Grafana queries of its template variables (`label_values(...)`, not PromQL)."""
    return [v["definition"] for v in dashboard["templating"]["list"] if v.get("type") == "query"]


def render() -> str:
    return json.dumps(build_dashboard(), indent=2, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed dashboard is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python grafana/generate.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
