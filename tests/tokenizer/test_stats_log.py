"""The periodic stats line: rates over the interval from the services' own metrics, quiet when idle."""

from __future__ import annotations

from himamba.common.metrics import (
    CACHE_HIT_TOKENS,
    CACHE_QUERY_TOKENS,
    POOL_CAPACITY_BYTES,
    POOL_USED_BYTES,
    SCHEDULER_RUNNING,
    SCHEDULER_WAITING,
    SERVICES,
    WORKER_STEP_TOKENS,
    WORKER_TENSOR_PARALLEL_RANKS,
)
from himamba.common.metrics_exposition import merge_expositions
from himamba.common.metrics_report import MetricsReporter
from himamba.services.tokenizer.stats_log import StatsLine, parse_samples


class _Server:
    def __init__(self) -> None:
        self.r = {s: MetricsReporter(s, None) for s in SERVICES}

    def m(self, service: str):  # type: ignore[no-untyped-def]
        return self.r[service].metrics

    def page(self):  # type: ignore[no-untyped-def]
        return parse_samples(merge_expositions((r.render() for r in self.r.values()), "model"))


def test_idle_server_logs_nothing_then_a_line_per_interval_of_work_then_one_when_idle():
    srv, line = _Server(), StatsLine()
    assert line.update(srv.page(), 0.0) is None  # first look: no interval yet
    assert line.update(srv.page(), 10.0) is None  # idle
    srv.m("worker")[WORKER_STEP_TOKENS].labels(mode="prefill").inc(1000)
    srv.m("worker")[WORKER_STEP_TOKENS].labels(mode="decode").inc(50)
    srv.m("scheduler")[SCHEDULER_RUNNING].set(3)
    srv.m("scheduler")[SCHEDULER_WAITING].set(1)
    srv.m("cache")[CACHE_QUERY_TOKENS].inc(800)
    srv.m("cache")[CACHE_HIT_TOKENS].labels(tier="device").inc(400)
    srv.m("cache")[CACHE_HIT_TOKENS].labels(tier="host").inc(200)
    srv.m("cache")[POOL_CAPACITY_BYTES].labels(tier="device", kind="kv").set(1000)
    srv.m("cache")[POOL_USED_BYTES].labels(tier="device", kind="kv").set(250)
    text = line.update(srv.page(), 20.0)
    assert text is not None
    assert text.startswith("stats: 3 running, 1 waiting | prefill 100.0 tok/s, decode 5.0 tok/s")
    assert "cache hits 75.0% of 800 prompt tokens (device 50.0%, host 25.0%, storage 0.0%)" in text
    assert "pools used: device kv 25.0%" in text
    assert "tp" not in text.rsplit("|", 1)[1]  # not sharded: not said
    srv.m("scheduler")[SCHEDULER_RUNNING].set(0)
    srv.m("scheduler")[SCHEDULER_WAITING].set(0)
    last = line.update(srv.page(), 30.0)  # the interval the server went idle: said once
    assert last is not None and "0 running, 0 waiting | prefill 0.0 tok/s" in last and "cache hits -" in last
    assert line.update(srv.page(), 40.0) is None


def test_a_restarted_service_never_gives_negative_rates():
    before, after = _Server(), _Server()
    before.m("worker")[WORKER_STEP_TOKENS].labels(mode="decode").inc(500)
    after.m("worker")[WORKER_STEP_TOKENS].labels(mode="decode").inc(20)  # counters started again
    after.m("scheduler")[SCHEDULER_RUNNING].set(1)
    line = StatsLine()
    line.update(before.page(), 0.0)
    text = line.update(after.page(), 10.0)
    assert text is not None and "decode 0.0 tok/s" in text


def test_a_sharded_model_says_its_tensor_parallel_size():
    srv, line = _Server(), StatsLine()
    srv.m("worker")[WORKER_TENSOR_PARALLEL_RANKS].set(2)
    line.update(srv.page(), 0.0)
    srv.m("scheduler")[SCHEDULER_RUNNING].set(1)
    text = line.update(srv.page(), 10.0)
    assert text is not None and text.endswith(" | tp 2")
