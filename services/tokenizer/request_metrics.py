"""The front door's per-request metrics: latency histograms and token counters.

Measured where every request passes (ZeroMQ and HTTP alike): arrival when the request is
accepted, a token time per scheduler output, the end when the final chunk is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from himamba.common.metrics import (
    REQUEST_CACHED_TOKENS,
    REQUEST_E2E,
    REQUEST_FINISHED,
    REQUEST_GENERATION_TOKENS,
    REQUEST_ITL,
    REQUEST_PROMPT_TOKENS,
    REQUEST_TTFT,
)
from himamba.common.metrics_report import ServiceMetrics
from himamba.common.types import FinishReason, Usage


@dataclass
class RequestClock:
    """Monotonic times of one request."""

    arrival: float
    last_token: float | None = None  # None until the first token


class RequestMetrics:
    """Records the tokenizer-owned request metrics into `metrics`."""

    def __init__(self, metrics: ServiceMetrics):
        self._m = metrics

    def on_tokens(self, clock: RequestClock, num_tokens: int, now: float) -> None:
        """`num_tokens` new tokens arrived at `now` (one scheduler output)."""
        if num_tokens <= 0:
            return
        if clock.last_token is None:
            self._m[REQUEST_TTFT].observe(max(0.0, now - clock.arrival))
            num_tokens -= 1  # the first token's latency is the TTFT, not an ITL
            if num_tokens:
                # Several tokens in the first output: the rest arrived at the same time.
                for _ in range(num_tokens):
                    self._m[REQUEST_ITL].observe(0.0)
        else:
            gap = max(0.0, now - clock.last_token) / num_tokens
            for _ in range(num_tokens):
                self._m[REQUEST_ITL].observe(gap)
        clock.last_token = now

    def on_finished(self, clock: RequestClock, reason: FinishReason, usage: Usage | None, now: float) -> None:
        """The request ended (any reason) at `now`; `usage` when the final chunk carried one."""
        self._m[REQUEST_E2E].observe(max(0.0, now - clock.arrival))
        self._m[REQUEST_FINISHED].labels(reason=reason).inc()
        if usage is not None:
            self._m[REQUEST_PROMPT_TOKENS].inc(max(0, usage.prompt_tokens))
            self._m[REQUEST_GENERATION_TOKENS].inc(max(0, usage.completion_tokens))
            cached = usage.cached_tokens
            for tier, n in (("device", cached.device), ("host", cached.host), ("storage", cached.storage)):
                if n > 0:
                    self._m[REQUEST_CACHED_TOKENS].labels(tier=tier).inc(n)
