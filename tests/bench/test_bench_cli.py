"""`himamba bench <sub>` keeps every subcommand and flag it had before the benchmarks moved into
bench/ (himamba.bench), and two of them run for real through the command line at their smallest sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from himamba.services.cli import main

# Each subcommand's flags when the benchmarks left services/ (more may come; none may go).
FLAGS = {
    "cache": "--backend --clients --each --first --gen --host-ratio --kv-frac --mamba-slots --no-memory --no-progress "
    "--out --page-size --policy --repeat --seed --storage-dir --storage-fsync --storage-page-kib --storage-pages "
    "--storage-url --tiers --turns --write-policy",
    "scheduler": "--clients --forward-ms --gen --mamba-slots --model --no-progress --out --prompt-len --requests --scale "
    "--scale-rounds --scale-steps --strategies --track-interval --turns",
    "forward": "--adaptive-threads --arch --batches --checkpoint --context --decode-steps --dtype --gen-batches "
    "--gen-prompt --gen-prompt-lens --gen-runs --gen-tokens --heap-reuse --near-tie --no-adaptive-threads "
    "--no-heap-reuse --no-phases --no-reference --omp-spin --omp-wait-policy --page-size --peer --peer-log "
    "--peer-python --preset --prompt-lens --repeats --seed --threads",
    "kernels": "--dtype --ops --out --repeats --tiny",
    "multiturn": "--configs --device --distribution --endpoint --max-parallel --model --no-progress --num-clients "
    "--num-rounds --out --output-length --preset --ready-queue-policy --request-length --request-rate --seed "
    "--server-args --sub-question-input-length --sweep --torch-threads",
    "structured": "--batches --gen --grammars --model --out --prompt-len --repeats",
    "serve-overhead": "--arch --batches --checkpoint --new-tokens --no-reference --omp-spin --out --peer --peer-python "
    "--preset --prompt-len --reference --runs --seed --threads",
    "launches": "--arch --batch --experts --out --prefill-seqs",
    "prefill-ab": "--against --arch --out --prefill-batches --preset --prompt-lens --quiet-wait --repeats --rounds "
    "--threads",
}


@pytest.mark.parametrize("sub", sorted(FLAGS))
def test_each_subcommand_keeps_its_help_and_flags(sub, capsys):
    with pytest.raises(SystemExit) as done:
        main(["bench", sub, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: himamba bench {sub}")
    missing = [flag for flag in FLAGS[sub].split() if f"{flag} " not in text and f"{flag}\n" not in text]
    assert missing == []


def test_an_unknown_subcommand_names_the_known_ones(capsys):
    assert main(["bench", "nonesuch"]) == 2
    assert "{" + ",".join(FLAGS) + "}" in capsys.readouterr().err


def _himamba(tmp_path, *args: str) -> subprocess.CompletedProcess[str]:
    """The command as a user runs it: its own interpreter, started in an empty folder."""
    env = dict(os.environ, PYTHONSAFEPATH="1")
    cmd = [sys.executable, "-P", "-m", "himamba.services.cli", *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_bench_cache_runs_at_its_smallest(tmp_path):
    out = tmp_path / "out"
    r = _himamba(
        tmp_path, "bench", "cache", "--clients", "1", "--turns", "2", "--first", "4", "--each", "4", "--gen", "1",
        "--page-size", "1", "--kv-frac", "2", "--repeat", "1", "--no-memory", "--no-progress", "--out", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    # Room for all of it: the second turn finds the first turn's whole prompt and answer cached.
    assert result["requests"] == 2 and result["cached_ratio"] == result["ideal_ratio"] == pytest.approx(
        5 / 13, abs=1e-4
    )
    assert json.loads((out / "cache.json").read_text())["machine"]["cores"] >= 1


def test_bench_scheduler_scale_runs_at_its_smallest(tmp_path, capsys):
    # In this process (the scale run starts the real scheduler and cache controller processes itself).
    out = tmp_path / "out"
    argv = ["bench", "scheduler", "--scale", "--scale-cases", "2x64", "--scale-steps", "2", "--scale-rounds", "1",
            "--forward-ms", "0", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    saved = json.loads((out / "scheduler_scale.json").read_text())
    assert list(saved["serial_ms_per_step"]) == ["2x64"] and saved["serial_ms_per_step"]["2x64"] > 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert json.loads(printed[-1]) == {"serial_ms_per_step": saved["serial_ms_per_step"]}


def test_a_malformed_scale_case_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as done:
        main(["bench", "scheduler", "--scale", "--scale-cases", "32by2048"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "RUNNINGxCONTEXT" in err and "'32by2048'" in err
