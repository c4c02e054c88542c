"""The periodic stats line an operator reads in the log, like vLLM's and sglang's.

Every `--stats-interval-s` the front door reads the server's own /metrics page (its services'
latest reports, so no new messages) and logs one line: running and waiting requests, prefill
and decode throughput of the worker, the token-weighted cache hit rate by tier, and pool use
by tier and kind. Idle servers stay quiet: a line is logged while there is work, and once more
when the server goes idle.

    stats: 3 running, 0 waiting | prefill 812.5 tok/s, decode 45.0 tok/s | cache hits 61.2% of 1234 prompt
    tokens (device 58.0%, host 3.2%, storage 0.0%) | pools used: device kv 12.0% mamba 40.0%, host kv 5.0% mamba 10.0%
"""

from __future__ import annotations

from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families

from himamba.common.metrics import (
    CACHE_HIT_TOKENS,
    CACHE_QUERY_TOKENS,
    KINDS,
    POOL_CAPACITY_BYTES,
    POOL_USED_BYTES,
    SCHEDULER_RUNNING,
    SCHEDULER_WAITING,
    TIERS,
    WORKER_STEP_TOKENS,
    WORKER_TENSOR_PARALLEL_RANKS,
)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_samples(text: str) -> Samples:
    """(name, sorted labels without model_name) -> value, for every sample of a metrics page."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def _get(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


class _Counters(NamedTuple):
    prefill: float
    decode: float
    query: float
    hits: tuple[float, ...]  # per tier, as TIERS


def _counters(samples: Samples) -> _Counters:
    steps = WORKER_STEP_TOKENS.name
    return _Counters(
        _get(samples, steps, mode="prefill"),
        _get(samples, steps, mode="decode"),
        _get(samples, CACHE_QUERY_TOKENS.name),
        tuple(_get(samples, CACHE_HIT_TOKENS.name, tier=t) for t in TIERS),
    )


class StatsLine:
    """Turns successive metrics pages into log lines (None when there is nothing to say)."""

    def __init__(self) -> None:
        self._last: _Counters | None = None
        self._last_at = 0.0
        self._was_active = False

    def update(self, samples: Samples, now: float) -> str | None:
        counters = _counters(samples)
        last, last_at = self._last, self._last_at
        self._last, self._last_at = counters, now
        if last is None or now <= last_at:
            return None
        # A restarted service starts its counters again: never report a negative rate.
        delta = _Counters(
            max(0.0, counters.prefill - last.prefill),
            max(0.0, counters.decode - last.decode),
            max(0.0, counters.query - last.query),
            tuple(max(0.0, a - b) for a, b in zip(counters.hits, last.hits, strict=True)),
        )
        running = _get(samples, SCHEDULER_RUNNING.name)
        waiting = _get(samples, SCHEDULER_WAITING.name)
        active = bool(running or waiting or delta.prefill or delta.decode or delta.query)
        if not active and not self._was_active:
            return None
        self._was_active = active
        dt = now - last_at
        parts = [
            f"{running:.0f} running, {waiting:.0f} waiting",
            f"prefill {delta.prefill / dt:.1f} tok/s, decode {delta.decode / dt:.1f} tok/s",
        ]
        if delta.query:
            by_tier = ", ".join(f"{t} {100 * h / delta.query:.1f}%" for t, h in zip(TIERS, delta.hits, strict=True))
            parts.append(
                f"cache hits {100 * sum(delta.hits) / delta.query:.1f}% of {delta.query:.0f} prompt tokens ({by_tier})"
            )
        else:
            parts.append("cache hits -")
        pools = []
        for tier in TIERS:
            used = []
            for kind in KINDS:
                cap = _get(samples, POOL_CAPACITY_BYTES.name, tier=tier, kind=kind)
                if cap > 0:
                    used.append(f"{kind} {100 * _get(samples, POOL_USED_BYTES.name, tier=tier, kind=kind) / cap:.1f}%")
            if used:
                pools.append(f"{tier} {' '.join(used)}")
        parts.append("pools used: " + (", ".join(pools) if pools else "-"))
        tp = _get(samples, WORKER_TENSOR_PARALLEL_RANKS.name)
        if tp > 1:  # a sharded model: its pools' shares are each rank's
            parts.append(f"tp {tp:.0f}")
        return "stats: " + " | ".join(parts)
