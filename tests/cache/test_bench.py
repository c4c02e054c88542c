"""`himamba bench cache` on a tiny trace: it runs, reports JSON last, and reaches the ideal ratio when all fits."""

from __future__ import annotations

import json

import pytest

from himamba.services.cache.bench import build_trace, main

TINY = ["--clients", "4", "--turns", "3", "--first", "32", "--each", "8", "--gen", "8", "--page-size", "4", "--no-memory"]


def last_json(capsys) -> dict:
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1])


def test_trace_rounds_extend_the_previous_turn():
    trace = build_trace(clients=2, turns=3, first=8, each=4, gen=2, page_size=2, seed=0)
    assert [(r.client, r.turn) for r in trace.requests] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    a1, a2 = trace.requests[0], trace.requests[2]
    assert a2.prompt[: len(a1.full)] == a1.full and len(a2.prompt) == len(a1.full) + 4
    assert a2.ideal_cached_len == len(a1.full) and a1.ideal_cached_len == 0
    assert trace.unique_tokens == 2 * (8 + 2 * (2 + 4) + 2)


@pytest.mark.parametrize("policy", ["lru", "scan_resistant"])
def test_with_room_for_everything_the_cache_reaches_the_ideal_ratio(capsys, policy):
    assert main(TINY + ["--kv-frac", "1.5", "--policy", policy]) == 0
    result = last_json(capsys)
    assert result["cached_ratio"] == result["ideal_ratio"] > 0.3
    assert result["host_ratio"] == 0 and result["requests"] == 12


def test_host_tier_serves_what_the_device_evicted(capsys):
    assert main(TINY + ["--kv-frac", "0.3", "--host-ratio", "4", "--mamba-slots", "3"]) == 0
    result = last_json(capsys)
    assert result["host_ratio"] > 0
    assert result["cached_ratio"] <= result["ideal_ratio"]


def test_bad_arguments_exit_with_usage_error():
    with pytest.raises(SystemExit):
        main(["--clients", "0"])


def test_storage_tier_reports_backend_and_machine_bandwidth(capsys, tmp_path):
    args = TINY + ["--tiers", "device,host,storage", "--storage-dir", str(tmp_path), "--storage-pages", "16", "--storage-page-kib", "4"]
    assert main(args) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["tiers"] == "device,host,storage" and result["host_ratio_arg"] == 2.0
    assert result["storage_pages_written"] == 16 and result["storage_pages_read"] == 16
    for key in ("storage_write_mb_s", "storage_read_mb_s", "storage_disk_read_mb_s", "storage_memcpy_gb_s"):
        assert result[key] > 0
    assert "storage (file" in out
