"""A service's own Prometheus registry, and the loop that reports it to the tokenizer.

Each service keeps a private CollectorRegistry holding only the families it owns
(`metrics.metrics_of(service)`), every label combination created at zero, plus its own
process metrics (`metrics.PROCESS_METRICS`, labelled by service). Every
`interval_s` it renders the registry in the text format and sends it as a `MetricsReport`
to the tokenizer, which serves it at `/metrics` beside its own: one scrape target per
server, no shared files (prometheus_client's multiprocess mode needs a shared directory
and cannot tell which process owns a gauge).

    reporter = MetricsReporter("cache", Outbox(ctx, cfg.endpoints.tokenizer_ipc), 1.0)
    reporter.on_collect(lambda m: m[POOL_USED_BYTES].labels(tier="device", kind="kv").set(n))
    actor.spawn(reporter.run(), "metrics")
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Callable, Iterator
from typing import ClassVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics_core import Metric as MetricFamily

from himamba.common.messages import MetricsReport
from himamba.common.metrics import PROCESS_METRICS, MetricDef, Service, metrics_of
from himamba.common.transport import Outbox

Metric = Counter | Gauge | Histogram

# `*_created` series (a gauge per counter and histogram child) were a quarter of all samples and
# no dashboard or alert reads them: Prometheus itself tracks counter resets.
disable_created_metrics()


class _ServiceProcessCollector:
    """This process's resident memory, CPU time, fds and start time (prometheus_client's
    process collector), as the `PROCESS_METRICS` families labelled service=<this service>."""

    _WANTED: ClassVar[dict[str, MetricDef]] = {d.name.removesuffix("_total"): d for d in PROCESS_METRICS}

    def __init__(self, service: Service):
        self.service = service
        self._inner = ProcessCollector(registry=None)

    def collect(self) -> Iterator[MetricFamily]:
        for family in self._inner.collect():
            defn = self._WANTED.get("himamba_" + family.name)
            if defn is None:
                continue
            out = MetricFamily(defn.name.removesuffix("_total"), defn.help, family.type)
            for sample in family.samples:
                out.add_sample("himamba_" + sample.name, {**sample.labels, "service": self.service}, sample.value)
            yield out


def _make(defn: MetricDef, registry: CollectorRegistry) -> Metric:
    if defn.type == "counter":
        return Counter(defn.name, defn.help, defn.labels, registry=registry)
    if defn.type == "gauge":
        return Gauge(defn.name, defn.help, defn.labels, registry=registry)
    return Histogram(defn.name, defn.help, defn.labels, registry=registry, buckets=defn.buckets)


class ServiceMetrics:
    """The live metric objects of one service, looked up by definition: `m[CACHE_QUERY_TOKENS].inc(n)`."""

    def __init__(self, service: Service, registry: CollectorRegistry):
        self.service = service
        self._by_name: dict[str, Metric] = {}
        for defn in metrics_of(service):
            metric = _make(defn, registry)
            # Create every labelled child now, so each series exists (at zero) from the start.
            for values in itertools.product(*(defn.values_of(label) for label in defn.labels)):
                if values:
                    metric.labels(*values)
            self._by_name[defn.name] = metric

    def __getitem__(self, defn: MetricDef) -> Metric:
        try:
            return self._by_name[defn.name]
        except KeyError:
            raise ValueError(f"metric {defn.name} is owned by {defn.service}, not {self.service}") from None


class MetricsReporter:
    """One service's registry plus the periodic `MetricsReport` to the tokenizer.

    `outbox` is None for the tokenizer itself (it serves its registry directly).
    Callbacks given to `on_collect` run before every render: the place to refresh gauges
    that are cheaper to read on demand than to keep up to date (pool occupancy).
    """

    def __init__(self, service: Service, outbox: Outbox | None, interval_s: float = 1.0):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.service = service
        self.registry = CollectorRegistry(auto_describe=True)
        self.metrics = ServiceMetrics(service, self.registry)
        self.registry.register(_ServiceProcessCollector(service))
        self._outbox = outbox
        self._interval_s = interval_s
        self._collectors: list[Callable[[ServiceMetrics], None]] = []

    def on_collect(self, fn: Callable[[ServiceMetrics], None]) -> None:
        """Run `fn(metrics)` before each render."""
        self._collectors.append(fn)

    def render(self) -> str:
        """The registry in the Prometheus text format (after the on_collect callbacks)."""
        for fn in self._collectors:
            fn(self.metrics)
        return generate_latest(self.registry).decode("utf-8")

    def report(self) -> MetricsReport:
        return MetricsReport(service=self.service, text=self.render(), pid=os.getpid())

    async def report_now(self) -> None:
        """Send the current metrics to the tokenizer now (e.g. right after becoming ready)."""
        if self._outbox is not None:
            await self._outbox.send(self.report())

    async def run(self) -> None:
        """Report every `interval_s` until cancelled. Start it once the service is ready:
        a report also tells the tokenizer that its sender is alive and ready."""
        while True:
            await self.report_now()
            await asyncio.sleep(self._interval_s)
