"""Falcon-H1 against transformers (prefill logits, greedy generation) for a transformers-saved checkpoint
with the gated mixer norm and every muP multiplier, a variant without the norm (tied head, biases,
a dt limit) and our checkpoint maker's; batching and prefix-cache behaviour."""

from __future__ import annotations

import pytest

from himamba.services.modelgen.checkpoint import make_checkpoint
from himamba.services.worker.loader import load_model
from himamba.services.worker.models.falcon_h1 import FalconH1Config
from tests.worker import family_checks as checks
from tests.worker.hf_reference import load_reference
from tests.worker.hf_reference_more import save_falcon_h1

PROMPT_LENGTHS = (1, 7, 64, 300, 700)
SOURCES = ("transformers", "transformers_plain", "modelgen")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, object]]:
    root = tmp_path_factory.mktemp("falcon_h1")
    paths = {
        "transformers": save_falcon_h1(root / "hf"),
        "transformers_plain": save_falcon_h1(
            root / "plain",
            seed=1,
            mamba_rms_norm=False,
            tie_word_embeddings=True,
            attention_bias=True,
            projectors_bias=True,
            mamba_proj_bias=True,
            time_step_limit=(0.002, 0.5),
            num_hidden_layers=2,
        ),
        "modelgen": make_checkpoint("falcon_h1", root / "gen", preset="tiny", seed=3),
    }
    return {name: (load_model(path), load_reference(path)) for name, path in paths.items()}


@pytest.mark.parametrize("source", SOURCES)
def test_prefill_logits_match_transformers(models: dict, source: str) -> None:
    ours, ref = models[source]
    checks.assert_prefill_parity(ours, ref, PROMPT_LENGTHS)


@pytest.mark.parametrize("source", SOURCES)
def test_greedy_generation_matches_transformers(models: dict, source: str) -> None:
    ours, ref = models[source]
    checks.assert_greedy_parity(ours, ref, PROMPT_LENGTHS if source == "transformers" else (1, 7, 64, 300))


def test_the_model_is_what_the_config_says(models: dict) -> None:
    ours, _ = models["transformers"]
    assert ours.kv_spec().num_layers == ours.state_spec().num_layers == 3
    assert ours.model.layers[0].mamba.norm is not None
    assert ours.config.ssm_multipliers == (1.1, 0.9, 1.2, 0.8, 1.05)
    plain, _ = models["transformers_plain"]
    assert plain.model.layers[0].mamba.norm is None and plain.lm_head.is_tied
    assert plain.model.layers[0].mamba.out_proj.bias is not None


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


def test_malformed_multipliers_are_rejected() -> None:
    with pytest.raises(ValueError, match="ssm_multipliers"):
        FalconH1Config.from_hf({"vocab_size": 8, "hidden_size": 64, "ssm_multipliers": [1.0, 2.0]})
