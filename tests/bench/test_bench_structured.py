"""`himamba bench structured`: one short run writes structured.json (the machine, the model, what
it printed) with a row per (batch, grammar), each decoding its whole budget, and its ratio."""

from __future__ import annotations

import json

import pytest

from himamba.bench.structured import main


@pytest.mark.slow
def test_a_short_run_writes_the_machine_the_model_and_each_case(capsys, tmp_path):
    out_dir = tmp_path / "out"
    assert main(["--batches", "1,2", "--gen", "6", "--repeats", "1", "--out", str(out_dir)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    saved = json.loads((out_dir / "structured.json").read_text())
    assert saved["benchmark"] == "structured"
    assert saved["machine"]["torch_threads"] == 1 and saved["machine"]["cores"] >= 1
    assert saved["model"]["architecture"] == "NemotronHForCausalLM" and saved["model"]["preset"] == "tiny"
    assert printed[0].startswith("machine: ") and printed[1].startswith("model: ")
    assert saved["printed"] == printed[: len(saved["printed"])]
    assert json.loads(printed[-1])["rows"] == saved["results"]
    rows = {(r["batch"], r["grammar"]): r for r in saved["results"]}
    assert set(rows) == {(b, g) for b in (1, 2) for g in ("unconstrained", "json_schema", "regex")}
    for (batch, grammar), r in rows.items():
        assert r["tokens"] == batch * 6 and r["tokens_per_s"] > 0  # every run decoded its whole budget
        base = rows[(batch, "unconstrained")]["tokens_per_s"]
        assert r["vs_unconstrained"] == round(r["tokens_per_s"] / base, 3)
        if grammar == "unconstrained":
            assert "worker_side" not in r
        else:  # what the constrained step adds in the worker, measured in-process
            side = r["worker_side"]
            assert side["mask_us"] > 0 and side["apply_us"] > 0 and side["feed_us"] > 0


def test_an_unknown_grammar_case_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--grammars", "yaml"])
    assert "unknown grammar case" in capsys.readouterr().err
