"""`himamba bench scheduler`: its report (table, last-line JSON, plot) on synthetic rows, and one short run
of one strategy that writes scheduler.json (the machine, the model and what it printed) and scheduler.png."""

from __future__ import annotations

import importlib.util
import json

import pytest

from himamba.bench.scheduler import main
from himamba.bench.scheduler_report import StrategyRow, compare, format_table, plot, summary_line
from himamba.bench.scheduler_scale import ScaleCase, run_scale

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _row(strategy: str, running: int, slots: int) -> StrategyRow:
    return StrategyRow(strategy, running, running * slots, float(slots), 100.0, 0.6, 0.7, True)


def test_table_and_summary_compare_lazy_with_extra_buffer():
    rows = [_row("extra_buffer", 10, 4), _row("extra_buffer_lazy", 13, 3), _row("no_buffer", 20, 2)]
    comparison = compare(rows)
    assert comparison.lazy_vs_extra_concurrency == 1.3
    lines = format_table(rows, comparison)
    assert lines[0].split()[:3] == ["strategy", "peak", "running"]
    assert [line.split()[0] for line in lines[1:4]] == ["extra_buffer", "extra_buffer_lazy", "no_buffer"]
    assert lines[-1].startswith("lazy / extra_buffer peak concurrency: 1.30x")
    summary = summary_line(rows, comparison)
    assert summary["rows"][2] == rows[2]._asdict() and summary["lazy_over_extra"] == 1.3


def test_without_both_buffered_strategies_there_is_no_ratio():
    rows = [_row("no_buffer", 20, 2)]
    comparison = compare(rows)
    assert comparison.lazy_vs_extra_concurrency is None
    assert len(format_table(rows, comparison)) == 2
    assert "lazy_over_extra" not in summary_line(rows, comparison)


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="needs matplotlib (pip; in the test extra)")
def test_plot_draws_one_bar_per_strategy(tmp_path):
    outcome = plot(tmp_path / "scheduler.png", [_row("extra_buffer", 10, 4), _row("no_buffer", 20, 2)], "title")
    assert outcome.written and (tmp_path / "scheduler.png").stat().st_size > 0


@pytest.mark.slow
def test_a_short_run_writes_the_machine_the_model_and_what_it_printed(capsys, tmp_path):
    out_dir = tmp_path / "out"
    argv = ["--strategies", "no_buffer", "--requests", "4", "--gen", "8", "--clients", "2", "--turns", "2",
            "--mamba-slots", "16", "--no-progress", "--out", str(out_dir)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    saved = json.loads((out_dir / "scheduler.json").read_text())
    assert saved["benchmark"] == "scheduler"
    assert saved["machine"]["torch_threads"] == 1 and saved["machine"]["cores"] >= 1
    assert saved["model"]["architecture"] == "NemotronHForCausalLM" and saved["model"]["preset"] == "tiny"
    assert printed[0].startswith("machine: ") and printed[1].startswith("model: ")
    assert saved["workload"]["strategies"] == ["no_buffer"] and saved["workload"]["flood_requests"] == 4
    assert saved["printed"] == printed[: len(saved["printed"])]
    assert saved["results"] == json.loads(printed[-1])
    (row,) = saved["results"]["rows"]
    assert row["strategy"] == "no_buffer" and row["invariants_ok"] and 0 <= row["cached_ratio"] <= row["ideal_ratio"]
    if HAS_MATPLOTLIB:
        assert saved["plot"] == "scheduler.png" and (out_dir / "scheduler.png").stat().st_size > 0
    else:
        assert saved["plot"] is None and saved["notes"]


@pytest.mark.slow
def test_the_scale_run_measures_decode_steps_against_the_real_scheduler(capsys, tmp_path):
    # One small case (the bench's own cases are 32/256 running x 2k/32k): the real scheduler and
    # cache controller processes, the stand-in worker, numbers and JSON.
    cases = (ScaleCase(4, 256), ScaleCase(4, 256, True))
    assert run_scale(tmp_path, forward_ms=2.0, steps=6, cases=cases, rounds=2) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    saved = json.loads((tmp_path / "scheduler_scale.json").read_text())
    assert saved["benchmark"] == "scheduler_scale" and saved["machine"]["cores"] >= 1
    assert set(saved["serial_ms_per_step"]) == {"4x256", "4x256-penalty"}
    for row in saved["rows"]:
        assert row["decode_steps"] >= 5 and row["serial_ms_per_step"] > 0 and row["run_batch_bytes_per_step"] > 0
        assert row["cache_cpu_ms_per_step"] >= 0 and row["scheduler_cpu_ms_per_step"] >= 0
        assert len(row["serial_ms_rounds"]) == 2 and row["serial_ms_per_step"] in row["serial_ms_rounds"]
    assert saved["workload"]["rounds"] == 2
    assert json.loads(printed[-1]) == {"serial_ms_per_step": saved["serial_ms_per_step"]}
