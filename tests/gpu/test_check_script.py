"""scripts/gpu/check.sh on this CPU machine: the dry run, the rehearsal (every step at tiny sizes, the
CUDA-only parts SKIP) and how a step's record is read, so that the script's logic is tested here, not
first on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "gpu" / "check.sh"
STEPS = ["install", "env", "kernels", "parity", "serve", "throughput", "copies", "tp"]

sys.path.insert(0, str(ROOT / "scripts" / "gpu"))
import check_record


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    # What is under test is the script, not this machine's speed: the rehearsal's step limits are
    # stretched (a step once ran out of time on CPU cores that a whole suite was sharing).
    env = {**os.environ, "HIMAMBA_CHECK_REHEARSAL_SCALE": "40"}
    return subprocess.run(
        ["bash", str(CHECK), *args], check=False, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )


def _check_lines(stdout: str) -> dict[str, str]:
    return {ln.split()[1]: ln.split()[2] for ln in stdout.splitlines() if ln.startswith("CHECK ")}


def test_dry_run_prints_every_step_as_skip(tmp_path):
    r = _run("--dry-run", str(tmp_path), timeout=60)
    assert r.returncode == 0, r.stderr
    assert _check_lines(r.stdout) == dict.fromkeys(STEPS, "SKIP")
    doc = json.loads((tmp_path / "gpu-check.json").read_text())
    assert [s["name"] for s in doc["steps"]] == STEPS


@pytest.mark.slow
def test_rehearsal_runs_every_step_on_the_cpu(tmp_path):
    r = _run("--rehearse", str(tmp_path), timeout=3600)
    lines = _check_lines(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert lines == {
        "install": "SKIP",  # tests/gpu/test_offline_install.py runs the install step
        "env": "INFO",
        "kernels": "PASS",
        "parity": "PASS",
        "serve": "PASS",
        "throughput": "INFO",
        "copies": "INFO",
        "tp": "PASS",  # over gloo: the rehearsal has no two GPUs
    }, r.stdout
    figures = json.loads((tmp_path / "throughput.json").read_text())
    assert set(figures["decode"]) == {"1", "4"} and figures["decode"]["1"]["graph"].startswith("SKIP")
    assert figures["decode"]["1"]["eager_tok_per_s"] > 0 and figures["decode"]["1"]["roofline_tok_per_s"] > 0
    copies = json.loads((tmp_path / "copies.json").read_text())
    assert copies["kv_pages"]["pageable_h2d_GBps"] > 0 and copies["kv_pages"]["pinned"].startswith("SKIP")


def test_only_runs_the_named_steps(tmp_path):
    r = _run("--rehearse", "--only", "copies", str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _check_lines(r.stdout) == {"copies": "INFO"}


def test_unknown_option_is_refused(tmp_path):
    r = _run("--fast", str(tmp_path), timeout=60)
    assert r.returncode == 2 and "unknown option --fast" in r.stderr


PLAIN = """tests/a.py::test_one PASSED [ 33%]
tests/a.py::test_two[x] FAILED [ 66%]
tests/a.py::test_three SKIPPED (no cuda) [100%]
FAILED tests/a.py::test_two[x] - AssertionError
"""
XDIST = """[gw0] [ 50%] PASSED tests/k.py::test_k[a]
[gw1] [100%] PASSED tests/k.py::test_k[b]
"""


def test_record_reads_plain_and_xdist_logs(tmp_path):
    assert check_record.test_counts(PLAIN) == {"PASSED": 1, "FAILED": 1, "SKIPPED": 1}
    assert check_record.test_counts(XDIST) == {"PASSED": 2}
    assert check_record.failed_tests(PLAIN) == ["tests/a.py::test_two[x]"]


def test_a_step_out_of_time_is_a_fail_saying_what_it_reached(tmp_path):
    log = tmp_path / "kernels.log"
    log.write_text(XDIST)
    line = check_record.record(tmp_path, "kernels", "tests", 124, 110.0, 110, str(log), "")
    assert line == "CHECK kernels FAIL timed out after 110 s; reached: passed=2"
    passing = check_record.record(tmp_path, "kernels", "tests", 0, 50.0, 110, str(log), "")
    assert passing == "CHECK kernels PASS passed=2"
    failing = tmp_path / "parity.log"
    failing.write_text(PLAIN)
    assert check_record.record(tmp_path, "parity", "tests", 1, 9.0, 70, str(failing), "").startswith(
        "CHECK parity FAIL passed=1 failed=1 skipped=1 failed: tests/a.py::test_two[x]"
    )
    doc = json.loads((tmp_path / "gpu-check.json").read_text())
    assert [s["status"] for s in doc["steps"]] == ["FAIL", "PASS", "FAIL"]


def test_a_measuring_step_reports_its_figures(tmp_path):
    log, figures = tmp_path / "copies.log", tmp_path / "copies.json"
    log.write_text("copies: done\n")
    figures.write_text(json.dumps({"dev_shm_bytes": 64, "kv_pages": {"pinned_h2d_GBps": 54.25}}))
    line = check_record.record(tmp_path, "copies", "figures", 0, 7.0, 20, str(log), str(figures))
    assert line == "CHECK copies INFO dev_shm_bytes=64 kv_pages=pinned_h2d_GBps:54.25"
    assert check_record.record(tmp_path, "copies", "figures", 1, 7.0, 20, str(log), "") == (
        "CHECK copies FAIL exit 1: copies: done"
    )
