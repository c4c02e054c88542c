"""The metric table follows the naming rules, and each service's registry exports its families."""

from __future__ import annotations

import asyncio
import re
import subprocess
import uuid

import msgspec
import pytest
import zmq
import zmq.asyncio

from himamba.common.messages import MetricsReport, ToTokenizer
from himamba.common.metrics import (
    ALL_METRICS,
    BUILD_INFO,
    CACHE_QUERY_TOKENS,
    LABEL_VALUES,
    POOL_USED_BYTES,
    PROCESS_METRICS,
    SERVICES,
    exported_names,
    metrics_of,
)
from himamba.common.metrics_exposition import merge_expositions
from himamba.common.metrics_report import MetricsReporter, ServiceMetrics
from himamba.common.transport import Outbox
from tests.system_packages import PROMETHEUS, requires

# The unit (or counted thing) each name ends with, before `_total`.
UNITS = {"bytes", "seconds", "tokens", "requests", "ops", "hits", "slots", "in_flight", "truncations",
         "failures", "errors", "retractions", "responses", "finished", "events", "fds", "steps",
         "up", "info", "ranks"}  # fmt: skip  (`up`: Prometheus' 1/0 reachability gauge; `info`: a labels-only gauge)


@pytest.mark.parametrize("defn", (*ALL_METRICS, *PROCESS_METRICS, BUILD_INFO), ids=lambda d: d.name)
def test_names_help_labels_and_buckets(defn):
    assert re.fullmatch(r"himamba_[a-z]+(_[a-z0-9]+)+", defn.name), defn.name
    base = defn.name.removesuffix("_total")
    assert (defn.type == "counter") == defn.name.endswith("_total")
    assert any(base.endswith("_" + u) for u in UNITS), f"{defn.name}: no unit at the end"
    assert defn.help and defn.help[0].isupper() and defn.help.endswith(".")
    assert defn.service in SERVICES or (defn in PROCESS_METRICS and defn.service == "every")
    for label in defn.labels:
        assert label in LABEL_VALUES
        assert set(defn.values_of(label)) <= set(LABEL_VALUES[label])
    if defn.type == "histogram":
        assert list(defn.buckets) == sorted(set(defn.buckets)) and defn.buckets
    else:
        assert defn.buckets == ()


def test_names_are_unique_and_every_service_owns_some():
    assert len({d.name for d in ALL_METRICS}) == len(ALL_METRICS)
    assert all(metrics_of(s) for s in SERVICES)
    assert sum(len(metrics_of(s)) for s in SERVICES) == len(ALL_METRICS)
    with pytest.raises(ValueError, match="service"):
        metrics_of("launcher")  # type: ignore[arg-type]


def test_the_issue_list_is_covered():
    names = exported_names()
    for family in ("pool_capacity", "pool_used", "pool_protected", "pool_evictable"):
        assert f"himamba_{family}_bytes" in names
    for name in (
        "himamba_cache_hit_tokens_total",
        "himamba_cache_query_tokens_total",
        "himamba_cache_mamba_state_hits_total",
        "himamba_request_time_to_first_token_seconds_bucket",
        "himamba_request_inter_token_latency_seconds_bucket",
        "himamba_request_e2e_latency_seconds_bucket",
        "himamba_scheduler_queue_time_seconds_bucket",
        "himamba_worker_step_time_seconds_bucket",
    ):
        assert name in names


def _samples(text: str) -> dict[str, float]:
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line and line[0] != "#"
    }


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_registry_exports_all_its_series_at_zero(service):
    text = MetricsReporter(service, None).render()
    samples = _samples(text)
    for defn in metrics_of(service):
        assert f"# TYPE {defn.name} {defn.type}" in text
        combos = 1
        for label in defn.labels:
            combos *= len(defn.values_of(label))
        head = defn.name + ("_count" if defn.type == "histogram" else "")
        assert len([k for k in samples if k.split("{")[0] == head]) == combos, defn.name
    others = [d.name for d in ALL_METRICS if d.service != service]
    assert not [n for n in others if f"# TYPE {n} " in text]
    for defn in PROCESS_METRICS:  # its own process, labelled with its name
        assert f'{defn.name}{{service="{service}"}}' in samples, defn.name
    assert "_created" not in text


def test_metrics_are_found_by_definition_and_collect_hooks_run():
    reporter = MetricsReporter("cache", None)
    reporter.metrics[CACHE_QUERY_TOKENS].inc(5)
    calls = []

    def refresh(m: ServiceMetrics) -> None:
        calls.append(1)
        m[POOL_USED_BYTES].labels(tier="host", kind="mamba").set(4096)

    reporter.on_collect(refresh)
    samples = _samples(reporter.render())
    assert calls == [1]
    assert samples["himamba_cache_query_tokens_total"] == 5
    assert samples['himamba_pool_used_bytes{kind="mamba",tier="host"}'] == 4096
    with pytest.raises(ValueError, match="owned by tokenizer"):
        reporter.metrics[next(d for d in ALL_METRICS if d.service == "tokenizer")]
    with pytest.raises(ValueError, match="interval_s"):
        MetricsReporter("cache", None, interval_s=0)


def test_reporter_sends_reports_to_the_tokenizer_inbox():
    endpoint = f"ipc://@himamba-test-{uuid.uuid4().hex[:12]}-metrics"

    async def scenario() -> MetricsReport:
        ctx = zmq.asyncio.Context()
        pull = ctx.socket(zmq.PULL)
        pull.bind(endpoint)
        reporter = MetricsReporter("worker", Outbox(ctx, endpoint), interval_s=0.05)
        task = asyncio.get_running_loop().create_task(reporter.run())
        try:
            reports = [msgspec.msgpack.decode(await pull.recv(), type=ToTokenizer) for _ in range(2)]
        finally:
            task.cancel()
            ctx.destroy(linger=0)
        assert all(isinstance(r, MetricsReport) for r in reports)
        return reports[-1]

    report = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert report.service == "worker"
    assert "# TYPE himamba_worker_step_time_seconds histogram" in report.text


@requires(PROMETHEUS)
def test_promtool_accepts_all_services_together():
    # Plain concatenation would repeat the process families: the front door merges them.
    text = merge_expositions((MetricsReporter(s, None).render() for s in SERVICES), "m")
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
