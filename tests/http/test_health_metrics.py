"""/health follows the peers' readiness and liveness; /metrics serves every service's metrics."""

from __future__ import annotations

import time
from typing import Any

from himamba.common.messages import MetricsReport, WorkerInfo
from tests.scrape import samples as scrape_samples

Harness = Any  # tests/http/conftest.py's Harness

_SCHEDULER_TEXT = (
    "# HELP himamba_scheduler_running_requests Requests admitted and running.\n"
    "# TYPE himamba_scheduler_running_requests gauge\n"
    "himamba_scheduler_running_requests 3.0\n"
)


def _wait_health(h: Harness, status: int, timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        r = h.get("/health", key=None)
        if r.status == status or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def _worker_info() -> WorkerInfo:
    return WorkerInfo(
        vocab_size=2048,
        eos_token_ids=[0],
        num_attention_layers=1,
        num_recurrent_layers=1,
        kv_bytes_per_token=8,
        state_bytes_per_slot=8,
        num_pages=8,
        num_state_slots=4,
        num_host_pages=0,
        num_host_state_slots=0,
        model_name="fake",
    )


def test_health_needs_every_service_ready_and_alive(harness: Harness):
    r = harness.get("/health", key=None)
    assert r.status == 503
    err = r.json()["error"]
    assert err["code"] == "not_ready"
    assert all(name in err["message"] for name in ("worker", "scheduler", "cache"))

    harness.peers.send(_worker_info())
    harness.peers.ready("scheduler")
    r = _wait_health(harness, 200, timeout_s=1.0)
    assert r.status == 503 and "cache" in r.json()["error"]["message"]
    assert "worker" not in r.json()["error"]["message"]

    harness.peers.ready("cache")
    assert _wait_health(harness, 200).json() == {"status": "ok"}

    # A service that reports metrics must keep reporting: silence means it is gone (restarting).
    harness.peers.send(MetricsReport(service="cache", text=""))
    r = _wait_health(harness, 503)
    assert r.status == 503 and r.json()["error"]["message"].endswith("cache")
    harness.peers.send(MetricsReport(service="cache", text=""))
    assert _wait_health(harness, 200, timeout_s=0.9).status == 200


def test_metrics_serves_own_families_and_peer_reports(harness: Harness):
    r = harness.post("/v1/completions", {"prompt": "count me", "max_tokens": 2})
    assert r.status == 200
    harness.peers.send(MetricsReport(service="scheduler", text=_SCHEDULER_TEXT))
    deadline = time.monotonic() + 5
    while True:
        scrape = harness.get("/metrics", key=None)
        text = scrape.body.decode()
        samples = scrape_samples(text)
        if samples.get("himamba_scheduler_running_requests") == 3.0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert scrape.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert samples["himamba_scheduler_running_requests"] == 3.0
    prompt_len = len(harness.tokenizer.encode("count me").ids)
    assert samples["himamba_request_prompt_tokens_total"] >= prompt_len
    assert samples["himamba_request_generation_tokens_total"] >= 2
    assert samples["himamba_request_time_to_first_token_seconds_count"] >= 1
    assert samples["himamba_request_inter_token_latency_seconds_count"] >= 1
    assert samples['himamba_request_finished_total{reason="length"}'] >= 1
    assert samples['himamba_request_cached_tokens_total{tier="device"}'] >= harness.cached.device
    assert samples['himamba_http_responses_total{route="completions",status="2xx"}'] >= 1
    # Each family once: the peer's report does not repeat the front door's families.
    types = [line.split(" ")[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types))


def test_stale_peer_reports_are_dropped(harness: Harness):
    harness.peers.send(
        MetricsReport(service="worker", text="# TYPE himamba_worker_probe gauge\nhimamba_worker_probe 1.0\n")
    )
    deadline = time.monotonic() + 5
    while "himamba_worker_probe" not in harness.get("/metrics", key=None).body.decode():
        assert time.monotonic() < deadline, "the worker's report never appeared"
        time.sleep(0.05)
    deadline = time.monotonic() + 5
    while "himamba_worker_probe" in harness.get("/metrics", key=None).body.decode():
        assert time.monotonic() < deadline, "a silent worker's report is still served"
        time.sleep(0.1)
