"""Granite-4.0-H against transformers: prefill logits and greedy generation for a dense rope
checkpoint, an MoE one (tied embeddings, attention bias, no rope) and our checkpoint maker's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from himamba.services.worker.loader import load_model
from himamba.services.worker.models.granite_hybrid import GraniteHybridConfig
from tests.worker import family_checks as checks
from tests.worker.harness import Harness
from tests.worker.hf_reference import greedy, last_logits

SOURCES = ("transformers", "transformers_moe", "modelgen")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return checks.family_checkpoints(
        tmp_path_factory.mktemp("granite"),
        "granite_hybrid",
        "GraniteMoeHybrid",
        "transformers_moe",
        modelgen_seed=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        position_embedding_type=None,
        tie_word_embeddings=True,
        attention_bias=True,
        layer_types=["attention", "mamba", "mamba"],
        num_hidden_layers=3,
    )


@pytest.fixture(scope="module")
def models(checkpoints: dict[str, Path]) -> dict[str, tuple[object, object]]:
    return checks.load_sources(checkpoints)


test_prefill_logits_match_transformers = checks.prefill_parity_test(SOURCES)


@pytest.mark.parametrize("source", SOURCES)
def test_greedy_generation_matches_transformers(models: dict, source: str) -> None:
    ours, ref = models[source]
    ids = checks.prompt(ours.vocab_size, 40, seed=12)
    assert Harness(ours).generate_greedy([ids], 32) == [greedy(ref, ids, 32)]


def test_variants_configure_what_they_claim(models: dict) -> None:
    dense, moe = models["transformers"][0], models["transformers_moe"][0]
    assert dense.config.rope_theta == 10000.0 and moe.config.rope_theta is None
    assert dense.model.layers[0].block_sparse_moe is None
    assert moe.model.layers[0].block_sparse_moe is not None
    assert moe.lm_head.is_tied and not dense.lm_head.is_tied
    assert moe.config.attention_bias and moe.model.layers[0].self_attn.q_proj.bias is not None
    assert dense.config.attention_multiplier == 0.0625 and dense.config.logits_scaling == 4.0


def test_published_config_spellings_load_the_same_model(
    checkpoints: dict[str, Path], models: dict, tmp_path: Path
) -> None:
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoints["transformers"], dst)
    config = json.loads((dst / "config.json").read_text())
    old = {"linear_attention": "mamba", "full_attention": "attention"}
    config["layer_types"] = [old[k] for k in config["layer_types"]]
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    config["mamba_d_head"] = "auto"
    (dst / "config.json").write_text(json.dumps(config))
    original, ref = models["transformers"]
    respelled = load_model(dst)
    assert respelled.config == original.config
    ids = checks.prompt(original.vocab_size, 20, seed=6)
    harness = Harness(respelled)
    logits = harness.prefill([harness.new_sequence()], [ids])
    assert (logits[0] - last_logits(ref, ids)).abs().max().item() < 1e-4


def test_inconsistent_mamba_head_dim_is_rejected() -> None:
    raw = {"vocab_size": 8, "hidden_size": 64, "num_hidden_layers": 1, "mamba_n_heads": 8, "mamba_d_head": 4}
    with pytest.raises(ValueError, match="mamba_d_head"):
        GraniteHybridConfig.from_hf(raw)


def test_unsupported_rope_type_is_rejected() -> None:
    raw = {
        "vocab_size": 8,
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "position_embedding_type": "rope",
        "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
    }
    with pytest.raises(ValueError, match="rope_type"):
        GraniteHybridConfig.from_hf(raw)
