"""lm-eval-harness (pinned in the `test` extra) runs a tiny local loglikelihood task against a
real `himamba serve` through its `local-completions` model (echo + logprobs with token-list
prompts, batched four to a request), offline; the same task scored by transformers on the same
checkpoint gives the same accuracy, and every loglikelihood agrees to 1e-4."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.live_server import start_live_server

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "tests" / "e2e" / "lm_eval_run.py"
TOL = 1e-4


def _run(model: str, model_args: str, batch_size: int, out: Path, hf_home: Path) -> dict:
    env = {
        **os.environ,
        "PYTHONSAFEPATH": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(hf_home),  # datasets' cache: this test's own
        "TOKENIZERS_PARALLELISM": "false",
    }
    proc = subprocess.run(
        [sys.executable, str(DRIVER), model, model_args, str(batch_size), str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_lm_eval_loglikelihood_task_equals_transformers(model_dir: Path, tmp_path: Path):
    server = start_live_server(model_dir, tmp_path / "logs")
    try:
        args = ",".join(
            [
                f"model={model_dir.name}",
                f"base_url={server.base_url}/v1/completions",
                f"tokenizer={model_dir}",
                "tokenizer_backend=huggingface",
                "num_concurrent=1",
                "max_retries=1",
            ]
        )
        served = _run("local-completions", args, 4, tmp_path / "served.json", tmp_path / "hf")
        stats = server.cache_stats()
        assert stats.invariants_ok, stats.invariants_error
    finally:
        server.stop()
    ref = _run("transformers-reference", f"pretrained={model_dir}", 1, tmp_path / "ref.json", tmp_path / "hf")
    assert len(served["loglikelihoods"]) == 8  # every doc of tests/data/lm_eval/tiny_ll.jsonl
    assert served["acc"] == ref["acc"]
    assert served["is_greedy"] == ref["is_greedy"]
    for doc, (got, want) in enumerate(zip(served["loglikelihoods"], ref["loglikelihoods"], strict=True)):
        assert got == pytest.approx(want, abs=TOL), doc
