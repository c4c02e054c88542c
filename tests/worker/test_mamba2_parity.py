"""Mamba2 (no attention at all) against transformers (prefill logits, greedy generation) for a
transformers-saved checkpoint and our checkpoint maker's; batching and prefix-cache behaviour with a
KV pool of zero layers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from himamba.services.worker.loader import load_model
from himamba.services.worker.models.mamba2 import Mamba2Config
from tests.worker import family_checks as checks
from tests.worker.harness import Harness
from tests.worker.hf_reference import last_logits

SOURCES = ("transformers", "transformers_tied", "modelgen")


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return checks.family_checkpoints(
        tmp_path_factory.mktemp("mamba2"),
        "mamba2",
        "Mamba2",
        "transformers_tied",
        tie_word_embeddings=True,
        use_bias=True,
        use_conv_bias=False,
        n_groups=1,
    )


@pytest.fixture(scope="module")
def models(paths: dict[str, Path]) -> dict[str, tuple[object, object]]:
    return checks.load_sources(paths)


test_prefill_logits_match_transformers = checks.prefill_parity_test(SOURCES)
test_greedy_generation_matches_transformers = checks.greedy_parity_test(SOURCES)


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


test_cache_behaviour = checks.cache_behaviour_test()


def test_inconsistent_heads_are_rejected() -> None:
    raw = json.loads(json.dumps({"vocab_size": 8, "hidden_size": 64, "num_heads": 8, "head_dim": 4}))
    with pytest.raises(ValueError, match="num_heads"):
        Mamba2Config.from_hf(raw)
