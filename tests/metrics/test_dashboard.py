"""grafana/himamba.json is generated from the metric table, is current, and queries only real metrics."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from pathlib import Path
from types import ModuleType

from himamba.common.metrics import exported_names
from tests.system_packages import PROMETHEUS, requires

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "grafana"
METRIC_RE = re.compile(r"\bhimamba_[a-z0-9_]+")


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("himamba_grafana_generate", GRAFANA / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _committed() -> dict:
    return json.loads((GRAFANA / "himamba.json").read_text())


def test_committed_dashboard_is_up_to_date():
    gen = _generator()
    assert (GRAFANA / "himamba.json").read_text() == gen.render(), "run: python grafana/generate.py"
    assert gen.main(["--check"]) == 0


def test_every_expression_names_only_defined_metrics():
    gen = _generator()
    dashboard = _committed()
    queries = gen.expressions(dashboard) + gen.variable_queries(dashboard)
    assert len(gen.expressions(dashboard)) >= 20
    names = exported_names()
    for expr in queries:
        used = METRIC_RE.findall(expr)
        assert used, f"no himamba metric in {expr!r}"
        assert set(used) <= names, f"{expr!r} uses {set(used) - names}"


def test_dashboard_covers_the_required_views():
    text = json.dumps(_committed())
    for needle in (
        "himamba_pool_used_bytes",  # occupancy per tier and kind
        "himamba_cache_hit_tokens_total",  # token-weighted hit rate per tier ...
        "himamba_cache_query_tokens_total",  # ... = rate(hit) / rate(query)
        "himamba_cache_backup_bytes_total",  # transfer throughput
        "himamba_scheduler_waiting_requests",  # queues
        "histogram_quantile",  # latency quantiles
        "himamba_process_resident_memory_bytes",  # per-service memory ...
        "himamba_process_cpu_seconds_total",  # ... and CPU
        'model_name=~\\"$model_name\\"',  # every query follows the Model variable
    ):
        assert needle in text


@requires(PROMETHEUS)
def test_every_expression_is_valid_promql(tmp_path: Path):
    gen = _generator()
    exprs = [
        e.replace("$__rate_interval", "1m").replace("$instance", ".*").replace("$model_name", ".*")
        for e in gen.expressions(_committed())
    ]
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"r{i}", "expr": e} for i, e in enumerate(exprs)]}]}
    path = tmp_path / "rules.json"  # promtool reads YAML, and JSON is YAML
    path.write_text(json.dumps(rules))
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_provisioning_files_point_at_each_other():
    datasource = (GRAFANA / "provisioning" / "datasources" / "himamba.yaml").read_text()
    provider = (GRAFANA / "provisioning" / "dashboards" / "himamba.yaml").read_text()
    scrape = (GRAFANA / "prometheus.yaml").read_text()
    assert "type: prometheus" in datasource and "apiVersion: 1" in datasource
    assert "type: file" in provider and "path:" in provider
    assert "metrics_path: /metrics" in scrape and "30000" in scrape
    variables = {v["name"]: v for v in _committed()["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
