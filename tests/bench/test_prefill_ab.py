"""`himamba bench prefill-ab`: both builds time every case in fresh processes, round by round; a build that
fails is named with its error; a build whose step takes no captures gets "n/a" for those cases."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from himamba.bench import forward, prefill_ab
from himamba.services.worker import heap_reuse

pytestmark = pytest.mark.slow


def _bench(tmp_path, against: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-P", "-m", "himamba.services.cli", "bench", "prefill-ab", "--against", against,
         "--preset", "tiny", "--threads", "1", "--quiet-wait", "0", "--out", str(tmp_path / "out"), *args],
        check=False, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_both_builds_time_every_case_in_every_round(tmp_path):
    r = _bench(
        tmp_path, sys.executable, "--rounds", "2", "--repeats", "2", "--prompt-lens", "8,24", "--prefill-batches", "3x8"
    )
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((tmp_path / "out" / "prefill_ab.json").read_text())
    cases = ["1 x 8", "1 x 24", "3 x 8", "3 x 8 with 2 captures each"]
    assert [row["case"] for row in report["rows"]] == cases
    for row in report["rows"]:
        for build in ("this", "against"):
            # 2 rounds x 2 repeats, each a fresh process timing the case after its warm-up step.
            assert row[build]["n"] == 4, row
            assert 0 < row[build]["min_ms"] <= row[build]["median_ms"] <= row[build]["p75_ms"]
        assert row["against_over_this"] > 0
    assert "round 2/2" in r.stderr and report["machine"] in r.stdout
    assert "| 3 x 8 with 2 captures each |" in r.stdout


def test_a_build_that_fails_is_named_with_its_error(tmp_path):
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named himamba' >&2\nexit 3\n")
    broken.chmod(0o755)
    r = _bench(tmp_path, str(broken), "--rounds", "1", "--repeats", "1", "--prompt-lens", "8", "--prefill-batches", "")
    assert r.returncode == 1
    assert f"the against build ({broken}) failed (exit 3)" in r.stderr and "No module named himamba" in r.stderr
    assert not (tmp_path / "out" / "prefill_ab.json").exists()


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["--rounds", "0"], "--rounds and --repeats must be at least 1"),
        (["--prefill-batches", "8by256"], "expected PROMPTSxTOKENS items"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, args, complaint):
    r = _bench(tmp_path, sys.executable, *args)
    assert r.returncode == 2 and complaint in r.stderr


def test_an_against_that_is_not_an_executable_is_refused(tmp_path):
    r = _bench(tmp_path, str(tmp_path / "no-such-python"))
    assert r.returncode == 2 and "no such executable" in r.stderr


_ENGINE = forward.OurEngine


class _NoCaptures:
    """The engine of a build from before captures: everything but `take_slot`."""

    def __init__(self, *args, **kwargs):
        self._engine = _ENGINE(*args, **kwargs)

    def __getattr__(self, name):
        if name == "take_slot":
            raise AttributeError(name)
        return getattr(self._engine, name)


def test_a_build_without_captures_times_the_rest(tmp_path, monkeypatch):
    monkeypatch.setattr(forward, "OurEngine", _NoCaptures)
    # Neither glibc's thresholds nor a thread count for the rest of this test process.
    monkeypatch.setattr(heap_reuse, "reuse_heap", lambda: heap_reuse.HeapReuse(False, "off (test)"))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    out = tmp_path / "child.json"
    prefill_ab.main(["--child", "nemotron_h", "tiny", "1", "1", json.dumps([[8], [8, 8]]), str(out)])
    times = json.loads(out.read_text())["times"]
    assert times["2 x 8 with 2 captures each"] is None
    assert len(times["1 x 8"]) == 1 and len(times["2 x 8"]) == 1
