"""The one /metrics page: the services' expositions merged by family, build info added, every
series labelled with the model name (escaped), and promtool accepts the result."""

from __future__ import annotations

import subprocess

import pytest
from prometheus_client.parser import text_string_to_metric_families

from himamba.common.config import CacheConfig, Config, ModelConfig
from himamba.common.metrics import BUILD_INFO, BUILD_INFO_LABELS, PROCESS_METRICS, SERVICES
from himamba.common.metrics_exposition import build_info_text, merge_expositions
from himamba.common.metrics_report import MetricsReporter
from tests.system_packages import PROMETHEUS, requires

NAME = 'my "model"\\v2'


@pytest.fixture(scope="module")
def page() -> str:
    cfg = Config(model=ModelConfig(dtype="bfloat16"), cache=CacheConfig(page_size=32))
    texts = [build_info_text(cfg), *(MetricsReporter(s, None).render() for s in SERVICES)]
    return merge_expositions(texts, NAME)


def test_each_family_once_with_all_services_process_series(page: str):
    types = [line.split(" ")[2] for line in page.splitlines() if line.startswith("# TYPE ")]
    helps = [line.split(" ")[2] for line in page.splitlines() if line.startswith("# HELP ")]
    assert len(types) == len(set(types)) and len(helps) == len(set(helps))
    families = {f.name: f for f in text_string_to_metric_families(page)}
    for defn in PROCESS_METRICS:
        family = families[defn.name.removesuffix("_total")]
        assert sorted(s.labels["service"] for s in family.samples) == sorted(SERVICES)


def test_every_sample_carries_the_model_name(page: str):
    n = 0
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            assert sample.labels["model_name"] == NAME
            n += 1
    assert n > 100


def test_build_info(page: str):
    (family,) = [f for f in text_string_to_metric_families(page) if f.name == BUILD_INFO.name]
    (sample,) = family.samples
    assert sample.value == 1
    assert set(sample.labels) == {*BUILD_INFO_LABELS, "model_name"}
    assert sample.labels["dtype"] == "bfloat16" and sample.labels["page_size"] == "32"


def test_labels_are_added_to_bare_and_labelled_samples():
    text = '# HELP a_total A.\n# TYPE a_total counter\na_total 1.0\na_total{x="}"} 2.0\nb{} 3\n'
    merged = merge_expositions([text], "m")
    assert 'a_total{model_name="m"} 1.0' in merged
    assert 'a_total{model_name="m",x="}"} 2.0' in merged
    assert 'b{model_name="m"} 3' in merged


@requires(PROMETHEUS)
def test_promtool_accepts_the_page(page: str):
    result = subprocess.run(["promtool", "check", "metrics"], input=page, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
