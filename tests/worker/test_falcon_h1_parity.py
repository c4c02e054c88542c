"""Falcon-H1 against transformers (prefill logits, greedy generation) for a transformers-saved checkpoint
with the gated mixer norm and every muP multiplier, a variant without the norm (tied head, biases,
a dt limit) and our checkpoint maker's; batching and prefix-cache behaviour."""

from __future__ import annotations

import pytest

from himamba.services.worker.models.falcon_h1 import FalconH1Config
from tests.worker import family_checks as checks

SOURCES = ("transformers", "transformers_plain", "modelgen")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, object]]:
    paths = checks.family_checkpoints(
        tmp_path_factory.mktemp("falcon_h1"),
        "falcon_h1",
        "FalconH1",
        "transformers_plain",
        mamba_rms_norm=False,
        tie_word_embeddings=True,
        attention_bias=True,
        projectors_bias=True,
        mamba_proj_bias=True,
        time_step_limit=(0.002, 0.5),
        num_hidden_layers=2,
    )
    return checks.load_sources(paths)


test_prefill_logits_match_transformers = checks.prefill_parity_test(SOURCES)
test_greedy_generation_matches_transformers = checks.greedy_parity_test(SOURCES)


def test_the_model_is_what_the_config_says(models: dict) -> None:
    ours, _ = models["transformers"]
    assert ours.kv_spec().num_layers == ours.state_spec().num_layers == 3
    assert ours.model.layers[0].mamba.norm is not None
    assert ours.config.ssm_multipliers == (1.1, 0.9, 1.2, 0.8, 1.05)
    plain, _ = models["transformers_plain"]
    assert plain.model.layers[0].mamba.norm is None and plain.lm_head.is_tied
    assert plain.model.layers[0].mamba.out_proj.bias is not None


test_cache_behaviour = checks.cache_behaviour_test()


def test_malformed_multipliers_are_rejected() -> None:
    with pytest.raises(ValueError, match="ssm_multipliers"):
        FalconH1Config.from_hf({"vocab_size": 8, "hidden_size": 64, "ssm_multipliers": [1.0, 2.0]})
