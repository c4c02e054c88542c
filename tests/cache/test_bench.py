"""`himamba bench cache` on a tiny trace: it runs, reports JSON last, reaches the ideal ratio when all fits, and
writes cache.json (the machine, the workload and what it printed) and cache.png."""

from __future__ import annotations

import importlib.util
import json

import pytest

from himamba.bench.cache import build_trace, main
from tests.system_packages import REDIS, skip_without, skip_without_mooncake

TRACE = ["--clients", "4", "--turns", "3", "--first", "32", "--each", "8", "--gen", "8", "--page-size", "4"]


@pytest.fixture
def tiny(tmp_path) -> list[str]:
    """The tiny trace's flags, writing its files under tmp_path/out."""
    return [*TRACE, "--no-memory", "--no-progress", "--out", str(tmp_path / "out")]


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
def test_with_room_for_everything_the_cache_reaches_the_ideal_ratio(capsys, tiny, policy):
    assert main(tiny + ["--kv-frac", "1.5", "--policy", policy]) == 0
    result = last_json(capsys)
    assert result["cached_ratio"] == result["ideal_ratio"] > 0.3
    assert result["host_ratio"] == 0 and result["requests"] == 12


def test_host_tier_serves_what_the_device_evicted(capsys, tiny):
    assert main(tiny + ["--kv-frac", "0.3", "--host-ratio", "4", "--mamba-slots", "3"]) == 0
    result = last_json(capsys)
    assert result["host_ratio"] > 0
    assert result["cached_ratio"] <= result["ideal_ratio"]


def test_bad_arguments_exit_with_usage_error():
    with pytest.raises(SystemExit):
        main(["--clients", "0"])


def test_storage_tier_reports_backend_and_machine_bandwidth(capsys, tmp_path, tiny):
    args = tiny + ["--tiers", "device,host,storage", "--storage-dir", str(tmp_path), "--storage-pages", "16", "--storage-page-kib", "4"]
    assert main(args) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["tiers"] == "device,host,storage" and result["host_ratio_arg"] == 2.0
    assert result["storage_pages_written"] == 16 and result["storage_pages_read"] == 16
    for key in ("storage_write_mb_s", "storage_read_mb_s", "storage_disk_read_mb_s", "storage_memcpy_gb_s"):
        assert result[key] > 0
    assert "storage (file" in out
    saved = json.loads((tmp_path / "out" / "cache.json").read_text())
    assert saved["workload"]["backend"] == "file" and saved["result"] == result


@pytest.mark.parametrize("backend", ["redis", "mooncake"])
def test_remote_backend_without_a_url_gets_a_local_store(capsys, tmp_path, tiny, backend):
    """`--backend redis|mooncake` with no --storage-url starts its own store, measures through
    it, and stops it."""
    if backend == "redis":
        skip_without(REDIS)
    else:
        skip_without_mooncake()
    args = [*tiny, "--tiers", "device,storage", "--backend", backend, "--storage-pages", "32", "--storage-page-kib", "16"]
    assert main(args) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["storage_backend"] == backend and result["storage_store"].startswith("local")
    assert result["storage_pages_written"] == 32 and result["storage_pages_read"] == 32
    assert result["storage_write_mb_s"] > 0 and result["storage_read_mb_s"] > 0
    assert f"storage ({backend}" in out


def test_files_hold_the_machine_the_workload_and_what_was_printed(capsys, tmp_path):
    out_dir = tmp_path / "report"
    assert main([*TRACE, "--repeat", "2", "--no-progress", "--out", str(out_dir), "--host-ratio", "2"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    saved = json.loads((out_dir / "cache.json").read_text())
    assert saved["benchmark"] == "cache"
    machine = saved["machine"]
    assert machine["cores"] >= 1 and machine["device"] == "cpu" and machine["torch_threads"] >= 1
    assert printed[0].startswith("machine: ") and printed[1].startswith("workload: 4 clients x 3 turns")
    assert saved["workload"]["clients"] == 4 and saved["workload"]["page_size"] == 4
    assert saved["workload"]["tiers"] == ["device", "host"] and saved["workload"]["backend"] is None
    # Every table line printed is in the file, and the result object equals the printed last line.
    assert saved["printed"] == printed[: len(saved["printed"])]
    assert any(line.startswith("throughput: ") for line in saved["printed"])
    assert saved["result"] == json.loads(printed[-1])
    assert len(saved["pass_requests_per_s"]) == 2
    assert printed[-2].startswith(f"wrote {out_dir / 'cache.json'}")
    if importlib.util.find_spec("matplotlib") is not None:
        assert saved["plot"] == "cache.png" and (out_dir / "cache.png").stat().st_size > 0
    else:
        assert saved["plot"] is None and saved["notes"]
