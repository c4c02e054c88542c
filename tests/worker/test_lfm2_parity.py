"""LFM2 against transformers (prefill logits, greedy generation) for a transformers-saved checkpoint,
a variant (conv bias, untied head, no MLP width adjustment) and our checkpoint maker's; batching and
prefix-cache behaviour with a conv window as the whole recurrent state."""

from __future__ import annotations

import pytest

from himamba.services.worker.models.lfm2 import Lfm2Config
from tests.worker import family_checks as checks

SOURCES = ("transformers", "transformers_plain", "modelgen")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, object]]:
    paths = checks.family_checkpoints(
        tmp_path_factory.mktemp("lfm2"),
        "lfm2",
        "Lfm2",
        "transformers_plain",
        conv_bias=True,
        tie_word_embeddings=False,
        block_auto_adjust_ff_dim=False,
        conv_L_cache=4,
        layer_types=["full_attention", "conv", "conv"],
        num_hidden_layers=3,
    )
    return checks.load_sources(paths)


test_prefill_logits_match_transformers = checks.prefill_parity_test(SOURCES)
test_greedy_generation_matches_transformers = checks.greedy_parity_test(SOURCES)


def test_the_model_is_what_the_config_says(models: dict) -> None:
    ours, _ = models["transformers"]
    assert ours.config.layer_kinds == ("conv", "attention", "conv", "attention")
    assert ours.config.mlp_width == 96  # int(2 * 128 / 3) = 85, rounded up to a multiple of 32
    (conv,) = ours.state_spec().layers[0]
    assert (conv.name, conv.shape) == ("conv", (64, 2))
    assert ours.lm_head.is_tied
    plain, _ = models["transformers_plain"]
    assert plain.config.mlp_width == 128 and not plain.lm_head.is_tied
    assert plain.model.layers[1].conv.conv.bias is not None


test_cache_behaviour = checks.cache_behaviour_test()


def test_bad_layer_types_are_rejected() -> None:
    raw = {"vocab_size": 8, "hidden_size": 64, "num_hidden_layers": 2, "layer_types": ["conv", "mamba"]}
    with pytest.raises(ValueError, match="layer_types"):
        Lfm2Config.from_hf(raw)
