"""What one benchmark run measured, per request and summed up per configuration."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

TIERS = ("device", "host", "storage")
# The goal compares TTFT from this round on: by then the history is long and mostly repeated.
LATE_ROUND = 3


@dataclass
class RequestRecord:
    """One request as the client saw it (times in seconds, from the moment it was sent)."""

    client: int
    round: int
    prompt_tokens: int
    repeated_tokens: int  # leading prompt tokens the conversation already held (the ideal hit)
    completion_tokens: int = 0
    cached: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation; None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class RunSummary:
    """One configuration at one request rate."""

    config: str
    request_rate: float
    num_requests: int
    num_failed: int
    duration_s: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    late_ttft_p50_s: float | None  # rounds >= LATE_ROUND
    itl_p50_s: float | None
    itl_p90_s: float | None
    e2e_p50_s: float | None
    e2e_p90_s: float | None
    input_tokens_per_s: float
    output_tokens_per_s: float
    cached_ratio: dict[str, float]  # per tier, and "total": cached prompt tokens / prompt tokens
    ideal_ratio: float
    max_prompt_tokens: int
    ratios_vs_none: dict[str, float] = field(default_factory=dict)

    @property
    def cached_vs_ideal(self) -> float | None:
        return self.cached_ratio["total"] / self.ideal_ratio if self.ideal_ratio else None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["request_rate"] = _json_rate(self.request_rate)
        out["cached_vs_ideal"] = self.cached_vs_ideal
        return out


def _json_rate(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def summarize(config: str, request_rate: float, records: Sequence[RequestRecord], duration_s: float) -> RunSummary:
    """Latency percentiles, throughput and cached-token ratios of one run."""
    done = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    late = [r.ttft_s for r in done if r.ttft_s is not None and r.round >= LATE_ROUND]
    itl = [gap for r in done for gap in r.itl_s]
    e2e = [r.e2e_s for r in done if r.e2e_s is not None]
    prompt = sum(r.prompt_tokens for r in done)
    repeated = sum(r.repeated_tokens for r in done)
    cached = {t: sum(r.cached[t] for r in done) for t in TIERS}
    ratio = {t: (cached[t] / prompt if prompt else 0.0) for t in TIERS}
    ratio["total"] = sum(cached.values()) / prompt if prompt else 0.0
    wall = max(duration_s, 1e-9)
    return RunSummary(
        config=config,
        request_rate=request_rate,
        num_requests=len(records),
        num_failed=len(records) - len(done),
        duration_s=duration_s,
        ttft_p50_s=percentile(ttft, 50),
        ttft_p90_s=percentile(ttft, 90),
        ttft_p99_s=percentile(ttft, 99),
        late_ttft_p50_s=percentile(late, 50),
        itl_p50_s=percentile(itl, 50),
        itl_p90_s=percentile(itl, 90),
        e2e_p50_s=percentile(e2e, 50),
        e2e_p90_s=percentile(e2e, 90),
        input_tokens_per_s=prompt / wall,
        output_tokens_per_s=sum(r.completion_tokens for r in done) / wall,
        cached_ratio=ratio,
        ideal_ratio=repeated / prompt if prompt else 0.0,
        max_prompt_tokens=max((r.prompt_tokens for r in done), default=0),
    )


def add_ratios_vs_none(rows: Sequence[RunSummary]) -> None:
    """Fill each row's `ratios_vs_none` against the `none` row at the same request rate:
    TTFT speedups (none / this) and throughput gains (this / none)."""
    base = {r.request_rate: r for r in rows if r.config == "none"}
    for row in rows:
        ref = base.get(row.request_rate)
        if ref is None:
            continue
        out: dict[str, float] = {}
        for key in ("ttft_p50_s", "late_ttft_p50_s", "e2e_p50_s"):
            mine, theirs = getattr(row, key), getattr(ref, key)
            if mine and theirs:
                out[key.removesuffix("_s") + "_speedup"] = theirs / mine
        for key in ("input_tokens_per_s", "output_tokens_per_s"):
            if getattr(ref, key):
                out[key.removesuffix("_per_s") + "_throughput_gain"] = getattr(row, key) / getattr(ref, key)
        row.ratios_vs_none = out
