"""What an operator sees of a real server: a clean start says what it runs and warns of nothing
else, the periodic stats line and the access log appear while serving, HIMAMBA_API_KEY and a
numeric --served-model-name work end to end."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.http_request import http_request
from tests.live_server import start_live_server

KEY = "918273645"  # numeric: once parsed as an int and refused


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from himamba.services.modelgen.checkpoint import make_checkpoint

    ckpt = make_checkpoint("nemotron_h", tmp_path_factory.mktemp("ckpt") / "nemotron-h-tiny", preset="tiny", seed=0)
    old = os.environ.get("HIMAMBA_API_KEY")
    os.environ["HIMAMBA_API_KEY"] = KEY  # the launcher reads it; not on the command line
    try:
        server = start_live_server(
            ckpt,
            tmp_path_factory.mktemp("logs"),
            "--served-model-name",
            "7",
            "--stats-interval-s",
            "0.3",
            "--access-log",
        )
    finally:
        if old is None:
            del os.environ["HIMAMBA_API_KEY"]
        else:
            os.environ["HIMAMBA_API_KEY"] = old
    server.api_key = KEY
    try:
        deadline = time.monotonic() + 30
        while "all services ready" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        yield server
    finally:
        server.stop()


def test_clean_start_warns_of_nothing_but_random_weights_and_says_what_it_runs(live: Any):
    log = live.log()
    warnings = [line for line in log.splitlines() if " WARNING " in line or " ERROR " in line]
    assert len(warnings) == 1 and "RANDOM WEIGHTS" in warnings[0], warnings
    # The disk tier is opt-in: nothing is written to disk, and the banner says how to turn it on.
    assert "storage tier on" not in log
    assert "storage tier (disk) off: --hicache-storage-backend file" in log
    assert re.search(r"dtype float32 \(--dtype auto on cpu", log)
    assert KEY not in log  # the key is not logged


def test_api_key_from_the_environment_and_a_numeric_model_name(live: Any):
    assert http_request(live.port, "GET", "/v1/models").status == 401
    models = http_request(live.port, "GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert models.status == 200 and [m["id"] for m in models.json()["data"]] == ["7"]


def test_stats_line_and_access_log_while_serving(live: Any):
    for i in range(3):
        live.post_json("/v1/completions", {"prompt": f"request {i}: " + "word " * 40, "max_tokens": 8, "model": "7"})
    deadline = time.monotonic() + 10
    pattern = re.compile(
        r"stats: \d+ running, \d+ waiting \| prefill ([0-9.]+) tok/s, decode ([0-9.]+) tok/s \| cache hits"
    )
    while not any(float(m.group(1)) > 0 for m in pattern.finditer(live.log())):
        assert time.monotonic() < deadline, live.log()[-3000:]
        time.sleep(0.2)
    assert "pools used: device kv" in live.log()
    access = [line for line in live.log().splitlines() if "himamba.tokenizer.access" in line]
    assert sum('"POST /v1/completions HTTP/1.1" 200' in line for line in access) == 3
    assert any('"GET /v1/models HTTP/1.1" 401' in line for line in access)
