"""`himamba bench forward` on a tiny checkpoint: the table, the JSON line, the cost model."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from himamba.bench.forward import Options, _decode_contexts, main, model_cost, run
from himamba.bench.generate import PeerError, VLLMPeer
from himamba.services.worker.loader import load_model
from tests.worker.hf_reference import save_nemotron_h


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_nemotron_h(Path(tmp_path_factory.mktemp("bench")) / "hf")


def _options(checkpoint: Path, reference: bool) -> Options:
    return Options(
        arch="nemotron_h",
        preset="tiny",
        dtype="float32",
        threads=1,
        prompt_lens=[8, 20],
        prefill_batches=[(3, 8)],
        batches=[1, 3],
        context=16,
        repeats=1,
        decode_steps=2,
        page_size=16,
        reference=reference,
        checkpoint=checkpoint,
        seed=0,
        omp_wait_policy="inherit",
        gen_batches=[1, 3],
        gen_prompt_lens=[20],
        gen_prompt=8,
        gen_tokens=4,
        gen_runs=1,
    )


def test_run_measures_both_engines_on_every_shape(checkpoint: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    summary = run(_options(checkpoint, reference=True), out, err)
    rows = summary["rows"]
    shapes = [(r["phase"], r["seqs"], r["size"], r["tokens_per_step"]) for r in rows]
    # One prompt of each length, three prompts of 8 in one step, then the decode batches.
    assert shapes == [
        ("prefill", 1, 8, 8),
        ("prefill", 1, 20, 20),
        ("prefill", 3, 8, 24),
        ("decode", 1, 1, 1),
        ("decode", 1, 3, 3),
    ]
    for r in rows:
        assert r["ours_tok_s"] > 0 and r["hf_tok_s"] > 0
        assert r["ratio"] == pytest.approx(r["ours_tok_s"] / r["hf_tok_s"])
        assert r["model_ms"] > 0 and r["build_ms"] > 0 and r["sample_ms"] > 0
        assert r["flops_fraction"] > 0
        assert (r["bandwidth_fraction"] is None) == (r["phase"] == "prefill")
    table = out.getvalue()
    for label in ("L=8", "L=20", "3x8", "B=1", "B=3", "matmul", "GFLOP/s", "torch threads 1"):
        assert label in table
    assert "decode B=3" in err.getvalue()  # the progress display
    json.dumps(summary)  # the summary is plain JSON


def test_generate_table_puts_transformers_generate_beside_ours(checkpoint: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    opts = _options(checkpoint, reference=True)
    opts.phases = False
    summary = run(opts, out, err)
    rows = summary["generate"]
    assert [(r["scenario"], r["phase"]) for r in rows] == [
        ("decode B=1", "decode"),
        ("decode B=3", "decode"),
        ("prefill L=20", "prefill"),
    ]
    for r in rows:
        for engine in ("ours", "transformers"):
            assert r[engine]["min"] <= r[engine]["median_tok_s"] <= r[engine]["max"] and r[engine]["min"] > 0
        assert r["ratios"]["transformers"] == pytest.approx(
            r["ours"]["median_tok_s"] / r["transformers"]["median_tok_s"]
        )
        (agreement,) = r["agreement"]
        # The same weights, greedy: tokens agree on every step compared (up to a near-tie, if any).
        assert agreement["engine"] == "transformers" and agreement["first_mismatch"] is None
    assert rows[0]["agreement"][0]["compared_steps"] >= 1
    table = out.getvalue()
    assert "transformers tok/s" in table and "greedy agreement" in table and "decode B=3" in table


_FAKE_PEER = """
import json, sys
args = json.loads(sys.argv[1])
if args["model"].endswith("broken"):
    sys.stderr.write("fake peer: cannot load the model\\n")
    sys.exit(3)
print(json.dumps({"ready": True, "version": "fake"}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    n = req["max_tokens"]
    gaps = [[1.0] * n for _ in req["prompts"]] if req["gaps"] else None
    toks = [[(p[-1] + i) % 50 for i in range(n)] for p in req["prompts"]]
    print(json.dumps({"seconds": 0.5, "first_seconds": 0.1, "tokens": toks, "top2_gaps": gaps}), flush=True)
"""


def _fake_peer(tmp_path: Path, model: str) -> VLLMPeer:
    import sys

    script = tmp_path / "peer.py"
    script.write_text(_FAKE_PEER)
    return VLLMPeer(Path(sys.executable), tmp_path / model, "float32", 1, 64, 4, 64, io.StringIO(), script=script)


def test_the_peer_protocol_carries_tokens_gaps_and_times(tmp_path: Path) -> None:
    peer = _fake_peer(tmp_path, "ok")
    try:
        assert peer.version == "fake"
        got = peer.generate([[3, 4], [9]], 3, gaps=True)
        assert got.tokens == [[4, 5, 6], [9, 10, 11]] and (got.seconds, got.first_seconds) == (0.5, 0.1)
        assert got.gaps == [[1.0] * 3] * 2
        assert peer.generate([[1]], 2).gaps is None
    finally:
        peer.close()
    assert peer.proc.returncode == 0  # stdin closed: the peer ends on its own


def test_a_peer_that_fails_to_start_is_reported_with_its_stderr(tmp_path: Path) -> None:
    with pytest.raises(PeerError, match="cannot load the model"):
        _fake_peer(tmp_path, "broken")


def test_main_ends_with_one_json_line(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--checkpoint", str(checkpoint), "--prompt-lens", "8", "--batches", "2", "--context", "16"]
    argv += ["--repeats", "1", "--decode-steps", "1", "--threads", "1", "--no-reference", "--prefill-batches", "2x8"]
    assert main([*argv, "--omp-wait-policy", "inherit"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)
    assert summary["bench"] == "forward" and summary["machine"]["torch_threads"] == 1
    assert [r["hf_tok_s"] for r in summary["rows"]] == [None, None, None]


def test_without_transformers_the_reference_is_an_error_naming_the_way_out(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import transformers` sees when absent
    argv = ["--checkpoint", str(checkpoint), "--prompt-lens", "8", "--batches", "2", "--context", "16"]
    argv += ["--repeats", "1", "--decode-steps", "1", "--threads", "1", "--no-phases", "--gen-batches", "1"]
    argv += ["--gen-prompt-lens", "8", "--gen-prompt", "8", "--gen-tokens", "2", "--gen-runs", "1"]
    assert main([*argv, "--omp-wait-policy", "inherit"]) == 1
    err = capsys.readouterr().err
    assert "transformers" in err and "--no-reference" in err and "Traceback" not in err
    assert main([*argv, "--no-reference", "--omp-wait-policy", "inherit"]) == 0  # ours alone still runs


def test_bad_arguments_are_rejected(checkpoint: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--checkpoint", str(checkpoint), "--batches", "0", "--omp-wait-policy", "inherit"])
    with pytest.raises(SystemExit):
        main(["--checkpoint", str(checkpoint), "--decode-steps", "0", "--omp-wait-policy", "inherit"])
    with pytest.raises(SystemExit):  # a peer needs its Python
        main(["--checkpoint", str(checkpoint), "--peer", "vllm", "--omp-wait-policy", "inherit"])


def test_cost_model_counts_weights_once(checkpoint: Path) -> None:
    model = load_model(checkpoint)
    cost = model_cost(model)
    embedding = model.model.embeddings.weight
    # The head is untied: a decode step reads every parameter but the embedding table.
    assert cost.weight_bytes_per_step == (cost.params - embedding.numel()) * 4
    assert cost.head_params == embedding.numel()
    # Longer contexts cost more attention FLOPs and KV bytes, nothing else.
    assert cost.decode_flops(200) > cost.decode_flops(100) > 2 * (cost.matmul_params + cost.head_params)
    assert cost.decode_bytes(2, 100) - cost.decode_bytes(1, 100) > cost.decode_bytes(1, 101) - cost.decode_bytes(1, 100)


def test_decode_contexts_are_mixed_around_the_target() -> None:
    assert _decode_contexts(1, 128) == [128]
    lens = _decode_contexts(32, 128)
    assert len(set(lens)) > 8 and all(120 <= n <= 136 for n in lens)
    assert abs(sum(lens) / len(lens) - 128) < 1


def test_prefill_batches_are_parsed_or_refused_by_name() -> None:
    from himamba.bench.forward import parse_args

    assert parse_args(["--prefill-batches", "8x256,2x16"]).prefill_batches == [(8, 256), (2, 16)]
    assert parse_args(["--prefill-batches", ""]).prefill_batches == []
    assert parse_args([]).prefill_batches == [(8, 256)]
    for bad in ("8", "8x", "0x16", "ax2"):
        with pytest.raises(SystemExit):
            parse_args(["--prefill-batches", bad])
