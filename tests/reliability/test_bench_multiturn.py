"""`himamba bench multiturn`: its workload, arrivals and summary arithmetic, and one short run
against the shared server (`--endpoint`) that writes the JSON (and the plot when matplotlib is
installed)."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from himamba.bench.arrivals import Arrivals
from himamba.bench.latency_summary import RequestRecord, add_ratios_vs_none, percentile, summarize
from himamba.bench.multiturn import main
from himamba.bench.multiturn_report import format_tables, goal_lines, limit_lines
from himamba.bench.ttft_limit import later_prefix_lens
from himamba.bench.workload import WorkloadSpec, conversations, ordinary_token_ids


def _spec(**kw) -> WorkloadSpec:
    base = dict(num_clients=3, num_rounds=4, request_length=10, sub_question_length=5, output_length=2, seed=3)
    return WorkloadSpec(**{**base, **kw})


def test_ideal_ratio_equals_the_share_of_repeated_prompt_tokens_of_a_played_workload():
    spec = _spec()
    prompts = repeated = 0
    for conv in conversations(spec, range(1, 100)):
        while not conv.finished:
            turn = conv.next_turn()
            assert turn.input_ids[: turn.repeated_len] == conv.history[: turn.repeated_len]
            prompts += len(turn.input_ids)
            repeated += turn.repeated_len
            conv.add_answer([7] * spec.output_length)
    assert prompts == sum(spec.request_length + r * (spec.sub_question_length + spec.output_length) for r in range(4)) * 3
    assert spec.ideal_cached_ratio == pytest.approx(repeated / prompts)
    assert spec.final_prompt_len == 10 + 3 * 7


def test_user_messages_depend_on_seed_client_and_round_only():
    a, b = conversations(_spec(), range(1, 1000)), conversations(_spec(), range(1, 1000))
    assert a[1].user_message(3) == b[1].user_message(3)
    assert a[1].user_message(3) != a[2].user_message(3) != a[2].user_message(2)
    assert len(a[0].user_message(1)) == 10 and len(a[0].user_message(2)) == 5
    other = conversations(_spec(seed=4), range(1, 1000))
    assert other[1].user_message(3) != a[1].user_message(3)


def test_a_conversation_refuses_a_round_past_the_last():
    conv = conversations(_spec(num_rounds=1), [5])[0]
    conv.next_turn()
    with pytest.raises(ValueError, match="num_rounds"):
        conv.next_turn()
    with pytest.raises(ValueError, match="num_clients"):
        _spec(num_clients=0)


def test_ordinary_token_ids_leave_out_special_tokens(tiny_model):
    ids = ordinary_token_ids(tiny_model)
    cfg = json.loads((tiny_model / "config.json").read_text())
    assert cfg["eos_token_id"] not in ids
    assert len(ids) > cfg["vocab_size"] - 20 and max(ids) < cfg["vocab_size"]


def test_percentile_interpolates_and_names_bad_input():
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0], 90) == pytest.approx(1.9)
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="q must be"):
        percentile([1.0], 101)


def test_arrival_gaps_have_the_rate_as_mean():
    poisson = Arrivals("poisson", 4.0, seed=1)
    uniform = Arrivals("uniform", 4.0, seed=1)
    gaps_p = [poisson.next_gap_s() for _ in range(20000)]
    gaps_u = [uniform.next_gap_s() for _ in range(20000)]
    assert sum(gaps_p) / len(gaps_p) == pytest.approx(0.25, rel=0.05)
    assert sum(gaps_u) / len(gaps_u) == pytest.approx(0.25, rel=0.05)
    assert 0 <= min(gaps_u) and max(gaps_u) <= 0.5
    assert Arrivals("poisson", math.inf, seed=1).next_gap_s() == 0.0
    with pytest.raises(ValueError, match="distribution"):
        Arrivals("gamma", 1.0, seed=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="request_rate"):
        Arrivals("poisson", 0.0, seed=1)


def _rec(client: int, rnd: int, prompt: int, repeated: int, device: int, ttft: float, ok: bool = True) -> RequestRecord:
    r = RequestRecord(client, rnd, prompt, repeated, completion_tokens=4, ttft_s=ttft, e2e_s=ttft + 1, itl_s=[0.1] * 3)
    r.cached["device"] = device
    r.error = None if ok else "boom"
    return r


def test_summary_counts_cached_and_ideal_tokens_and_late_rounds_apart():
    records = [_rec(0, 1, 100, 0, 0, 1.0), _rec(0, 2, 200, 104, 96, 0.5), _rec(0, 3, 300, 204, 192, 0.2),
               _rec(1, 1, 100, 0, 0, 9.0, ok=False)]  # fmt: skip
    s = summarize("host", 2.0, records, duration_s=10.0)
    assert (s.num_requests, s.num_failed) == (4, 1)
    assert s.cached_ratio["device"] == pytest.approx(288 / 600)
    assert s.cached_ratio["total"] == pytest.approx(288 / 600) and s.cached_ratio["host"] == 0
    assert s.ideal_ratio == pytest.approx(308 / 600)
    assert s.late_ttft_p50_s == pytest.approx(0.2)
    assert s.ttft_p50_s == pytest.approx(0.5)
    assert s.input_tokens_per_s == pytest.approx(60.0) and s.output_tokens_per_s == pytest.approx(1.2)
    assert s.max_prompt_tokens == 300


def test_ratios_against_none_and_the_goal_lines():
    none = summarize("none", 1.0, [_rec(0, 3, 3000, 2800, 0, 4.0)], 10.0)
    host = summarize("host", 1.0, [_rec(0, 3, 3000, 2800, 2784, 0.5)], 5.0)
    add_ratios_vs_none([none, host])
    assert host.ratios_vs_none["late_ttft_p50_speedup"] == pytest.approx(8.0)
    assert host.ratios_vs_none["output_tokens_throughput_gain"] == pytest.approx(2.0)
    table = format_tables([none, host])
    assert "host" in table and "8.00x" in table
    (line,) = goal_lines([none, host])
    assert "8.00x" in line and "met" in line and "NOT" not in line
    head, *rows = limit_lines([none, host], limit_s=0.4, new_tokens=256)
    assert "256 new tokens in 400.0 ms" in head
    assert rows[0].startswith("none @") and "10.00x the limit (NOT met" in rows[0]
    assert rows[1].startswith("host @") and "1.25x the limit (met" in rows[1]


def test_the_limit_is_measured_over_each_later_rounds_history():
    spec = WorkloadSpec(num_clients=2, num_rounds=6, request_length=256, sub_question_length=100, output_length=32, seed=0)
    assert later_prefix_lens(spec, 3) == [256 + 3 * 132 - 100, 256 + 4 * 132 - 100, 256 + 5 * 132 - 100]


def test_a_short_run_against_a_running_server_writes_json(served, tiny_model, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--endpoint", served.main.endpoint, "--model", str(tiny_model), "--num-clients", "3", "--max-parallel", "2",
            "--num-rounds", "3", "--request-length", "40", "--output-length", "3", "--request-rate", "inf",
            "--seed", "5", "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "machine:" in printed and "model:" in printed and "external" in printed
    assert "limit of caching" in printed and "external @" in printed
    report = json.loads((out / "multiturn.json").read_text())
    (row,) = report["results"]
    assert row["num_requests"] == 9 and row["num_failed"] == 0
    assert row["ideal_ratio"] == pytest.approx(report["workload"]["ideal_cached_ratio"])
    assert 0 < row["cached_ratio"]["total"] <= row["ideal_ratio"]
    assert report["machine"]["cores"] >= 1 and report["model"]["vocab_size"] == 2048
    assert report["model"]["dtype"] == "float32"  # --dtype auto on cpu, as the server resolves it
    assert report["ttft_limit"]["seconds"] > 0 and report["ttft_limit"]["new_tokens"] == 40
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    assert (out / "multiturn.png").exists() == has_mpl
    assert (report["plot"] is None) != has_mpl
