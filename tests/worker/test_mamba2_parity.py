"""Mamba2 (no attention at all) against transformers (prefill logits, greedy generation) for a
transformers-saved checkpoint and our checkpoint maker's; batching and prefix-cache behaviour with a
KV pool of zero layers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from himamba.services.modelgen.checkpoint import make_checkpoint
from himamba.services.worker.loader import load_model
from himamba.services.worker.models.mamba2 import Mamba2Config
from tests.worker import family_checks as checks
from tests.worker.harness import Harness
from tests.worker.hf_reference import last_logits, load_reference
from tests.worker.hf_reference_more import save_mamba2

PROMPT_LENGTHS = (1, 7, 64, 300, 700)
SOURCES = ("transformers", "transformers_tied", "modelgen")


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mamba2")
    return {
        "transformers": save_mamba2(root / "hf"),
        "transformers_tied": save_mamba2(
            root / "tied", seed=1, tie_word_embeddings=True, use_bias=True, use_conv_bias=False, n_groups=1
        ),
        "modelgen": make_checkpoint("mamba2", root / "gen", preset="tiny", seed=3),
    }


@pytest.fixture(scope="module")
def models(paths: dict[str, Path]) -> dict[str, tuple[object, object]]:
    return {name: (load_model(path), load_reference(path)) for name, path in paths.items()}


@pytest.mark.parametrize("source", SOURCES)
def test_prefill_logits_match_transformers(models: dict, source: str) -> None:
    ours, ref = models[source]
    checks.assert_prefill_parity(ours, ref, PROMPT_LENGTHS)


@pytest.mark.parametrize("source", SOURCES)
def test_greedy_generation_matches_transformers(models: dict, source: str) -> None:
    ours, ref = models[source]
    checks.assert_greedy_parity(ours, ref, PROMPT_LENGTHS if source == "transformers" else (1, 7, 64, 300))


def test_the_kv_spec_is_empty(models: dict) -> None:
    ours, _ = models["transformers"]
    assert ours.kv_spec().num_layers == 0 and ours.kv_spec().bytes_per_token() == 0
    assert ours.state_spec().num_layers == 3
    harness = Harness(ours)
    assert harness.kv.k == [] and harness.kv.v == []


def test_the_old_embedding_name_loads(paths: dict[str, Path], models: dict, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "old"
    shutil.copytree(paths["transformers"], dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors["backbone.embedding.weight"] = tensors.pop("backbone.embeddings.weight")
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    ours = load_model(dst)
    ids = checks.prompt(ours.vocab_size, 20, seed=5)
    harness = Harness(ours)
    logits = harness.prefill([harness.new_sequence()], [ids])
    assert (logits[0] - last_logits(models["transformers"][1], ids)).abs().max().item() < checks.LOGIT_TOL


@pytest.mark.parametrize(
    "check",
    [
        checks.assert_batch_equals_one_by_one,
        checks.assert_split_prefill_equals_one_prefill,
        checks.assert_captures_equal_prefix_prefills,
        checks.assert_restored_capture_continues,
        checks.assert_host_round_trip_continues,
        checks.assert_fresh_sequence_ignores_its_slot,
    ],
    ids=lambda c: c.__name__.removeprefix("assert_"),
)
def test_cache_behaviour(models: dict, check) -> None:
    check(models["transformers"][0])


def test_inconsistent_heads_are_rejected() -> None:
    raw = json.loads(json.dumps({"vocab_size": 8, "hidden_size": 64, "num_heads": 8, "head_dim": 4}))
    with pytest.raises(ValueError, match="num_heads"):
        Mamba2Config.from_hf(raw)
