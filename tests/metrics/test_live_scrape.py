"""A live server's /metrics after traffic: promtool accepts it, the front door's metrics moved,
every dashboard expression resolves to an exported metric, the pool gauges move."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from himamba.common.metrics import BUILD_INFO_LABELS, PROCESS_METRICS, SERVICES, metrics_of
from tests.scrape import samples as scrape_samples
from tests.system_packages import PROMETHEUS, requires

ROOT = Path(__file__).resolve().parents[2]
PAGE_SIZE = 16
DEVICE_TOKENS = 1024  # a small device pool, so that distinct prompts fill it
REPORT_INTERVAL_S = 0.2
MODEL_NAME = 'tiny "hybrid"\\1'  # a label value that needs escaping

def _samples(text: str) -> dict[str, float]:
    return scrape_samples(text)


def _families(text: str) -> set[str]:
    return {line.split(" ")[2] for line in text.splitlines() if line.startswith("# TYPE ")}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, start_live_server_fn: Any) -> Iterator[Any]:
    from himamba.services.modelgen.checkpoint import make_checkpoint

    ckpt = make_checkpoint("nemotron_h", tmp_path_factory.mktemp("ckpt") / "nemotron-h-tiny", preset="tiny", seed=0)
    server = start_live_server_fn(
        ckpt,
        tmp_path_factory.mktemp("logs"),
        "--served-model-name",
        MODEL_NAME,
        "--report-interval-s",
        str(REPORT_INTERVAL_S),
        "--page-size",
        str(PAGE_SIZE),
        "--max-total-tokens",
        str(DEVICE_TOKENS),
        "--max-context-len",
        str(DEVICE_TOKENS // 2),  # the pool must hold one request of the whole context
        "--hicache-storage-backend",
        "none",  # device and host pools only: this module watches their gauges
    )
    try:
        yield server
    finally:
        server.stop()


def _scrape(live: Any) -> str:
    r = live.get("/metrics")
    assert r.status == 200
    return r.body.decode()


def _complete(live: Any, prompt: str, max_tokens: int = 4, stream: bool = False) -> Any:
    return live.post_json(
        "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    )


@pytest.fixture(scope="module")
def after_traffic(live: Any) -> str:
    prefix = "".join(f"value_{i} = compute({i})\n" for i in range(20))
    _complete(live, prefix + "# a")
    _complete(live, prefix + "# b")
    live.post_json(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    )
    time.sleep(3 * REPORT_INTERVAL_S)  # let every service report after the traffic
    return _scrape(live)


@requires(PROMETHEUS)
def test_promtool_accepts_the_scrape(after_traffic: str):
    result = subprocess.run(["promtool", "check", "metrics"], input=after_traffic, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_front_door_metrics_moved(after_traffic: str):
    s = _samples(after_traffic)
    assert s["himamba_request_prompt_tokens_total"] > 2 * 20
    assert s["himamba_request_generation_tokens_total"] == 4 + 4 + 3
    assert s['himamba_request_finished_total{reason="length"}'] == 3
    assert s["himamba_request_time_to_first_token_seconds_count"] == 3
    assert s["himamba_request_inter_token_latency_seconds_count"] == 3 + 3 + 2
    assert s["himamba_request_e2e_latency_seconds_count"] == 3
    assert s['himamba_request_cached_tokens_total{tier="device"}'] > 0  # the repeated prefix
    assert s['himamba_http_responses_total{route="completions",status="2xx"}'] == 2
    families = _families(after_traffic)
    assert {d.name for d in metrics_of("tokenizer")} <= families


def test_every_series_names_the_model_and_none_is_created(after_traffic: str):
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(after_traffic):
        for sample in family.samples:
            assert sample.labels.get("model_name") == MODEL_NAME, sample
    assert not [line for line in after_traffic.splitlines() if "_created" in line]


def test_build_info_says_what_runs(after_traffic: str):
    (info,) = [k for k in _samples(after_traffic) if k.startswith("himamba_build_info{")]
    assert _samples(after_traffic)[info] == 1
    for label in BUILD_INFO_LABELS:
        assert f"{label}=" in info
    assert 'dtype="float32"' in info and 'page_size="16"' in info and 'device="cpu"' in info


def test_each_service_reports_its_own_process(after_traffic: str):
    s = _samples(after_traffic)
    for service in SERVICES:
        for defn in PROCESS_METRICS:
            assert f'{defn.name}{{service="{service}"}}' in s, (defn.name, service)
        assert s[f'himamba_process_resident_memory_bytes{{service="{service}"}}'] > 10e6
        assert s[f'himamba_process_cpu_seconds_total{{service="{service}"}}'] > 0


def test_no_family_is_exported_twice(after_traffic: str):
    types = [line.split(" ")[2] for line in after_traffic.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types))


@pytest.mark.parametrize("service", [s for s in SERVICES if s != "tokenizer"])
def test_every_service_reports(after_traffic: str, service: str):
    assert {d.name for d in metrics_of(service)} <= _families(after_traffic)


def test_every_dashboard_expression_resolves_to_an_exported_metric(after_traffic: str):
    spec = importlib.util.spec_from_file_location("himamba_grafana_generate", ROOT / "grafana" / "generate.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    dashboard = json.loads((ROOT / "grafana" / "himamba.json").read_text())
    series = {name.split("{")[0] for name in _samples(after_traffic)}
    for expr in gen.expressions(dashboard) + gen.variable_queries(dashboard):
        for name in re.findall(r"\bhimamba_[a-z0-9_]+", expr):
            assert name in series, f"{name} (in {expr!r}) is not exported by the server"


def test_occupancy_gauges_move_with_requests_and_when_the_cache_fills(live: Any, after_traffic: str):
    kv_used = 'himamba_pool_used_bytes{kind="kv",tier="device"}'
    kv_cap = 'himamba_pool_capacity_bytes{kind="kv",tier="device"}'
    evictable = 'himamba_pool_evictable_bytes{kind="kv",tier="device"}'
    evicted = 'himamba_cache_evicted_bytes_total{kind="kv",tier="device"}'
    before = _samples(after_traffic)
    assert before[kv_cap] > 0
    assert before[kv_used] > 0 and before[evictable] > 0  # finished requests left cached prefixes
    # Distinct prompts that together need several times the device pool.
    for i in range(8):
        _complete(live, "".join(f"item_{i}_{j} = {j} * {i}\n" for j in range(40)), max_tokens=2)
    time.sleep(3 * REPORT_INTERVAL_S)
    after = _samples(_scrape(live))
    assert after[evicted] > before[evicted]
    assert after[kv_used] >= before[kv_used]
    assert after[kv_used] <= after[kv_cap]
    # write_through: what the device held was copied to host, KV pages and states both counted.
    assert after['himamba_cache_backup_ops_total{tier="host"}'] > 0
    assert after['himamba_cache_backup_bytes_total{kind="kv",tier="host"}'] > 0
    assert after['himamba_cache_backup_bytes_total{kind="mamba",tier="host"}'] > 0
    hits = sum(v for k, v in after.items() if k.startswith("himamba_cache_hit_tokens_total"))
    assert 0 < hits <= after["himamba_cache_query_tokens_total"]
