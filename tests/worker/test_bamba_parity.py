"""Bamba against transformers (prefill logits, greedy generation) for a transformers-saved checkpoint
(partial rope, GQA, two Mamba2 groups) and our checkpoint maker's; batching and prefix-cache behaviour."""

from __future__ import annotations

import pytest

from himamba.services.worker.models.bamba import BambaConfig
from tests.worker import family_checks as checks


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, object]]:
    paths = checks.family_checkpoints(
        tmp_path_factory.mktemp("bamba"),
        "bamba",
        "Bamba",
        "transformers_tied",
        tie_word_embeddings=True,
        attention_bias=True,
        attn_layer_indices=[0],
        num_hidden_layers=2,
        mlp_bias=True,
    )
    return checks.load_sources(paths)


test_prefill_logits_match_transformers = checks.prefill_parity_test(("transformers", "transformers_tied", "modelgen"))
test_greedy_generation_matches_transformers = checks.greedy_parity_test(
    ("transformers", "modelgen"), long_sources=("transformers", "modelgen")
)


def test_the_model_is_what_the_config_says(models: dict) -> None:
    ours, _ = models["transformers"]
    assert ours.config.layer_kinds == ("mamba", "attention", "mamba", "attention")
    assert ours.config.rope.partial_rotary_factor == 0.5
    assert ours.kv_spec().num_layers == 2 and ours.state_spec().num_layers == 2
    tied, _ = models["transformers_tied"]
    assert tied.lm_head.is_tied and tied.model.layers[0].self_attn.q_proj.bias is not None


test_cache_behaviour = checks.cache_behaviour_test()


def test_bad_attention_indices_are_rejected() -> None:
    with pytest.raises(ValueError, match="attn_layer_indices"):
        BambaConfig.from_hf({"vocab_size": 8, "hidden_size": 64, "num_hidden_layers": 2, "attn_layer_indices": [5]})
