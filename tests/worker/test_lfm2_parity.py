"""LFM2 against transformers (prefill logits, greedy generation) for a transformers-saved checkpoint,
a variant (conv bias, untied head, no MLP width adjustment) and our checkpoint maker's; batching and
prefix-cache behaviour with a conv window as the whole recurrent state."""

from __future__ import annotations

import pytest

from himamba.services.modelgen.checkpoint import make_checkpoint
from himamba.services.worker.loader import load_model
from himamba.services.worker.models.lfm2 import Lfm2Config
from tests.worker import family_checks as checks
from tests.worker.hf_reference import load_reference
from tests.worker.hf_reference_more import save_lfm2

PROMPT_LENGTHS = (1, 7, 64, 300, 700)
SOURCES = ("transformers", "transformers_plain", "modelgen")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, object]]:
    root = tmp_path_factory.mktemp("lfm2")
    paths = {
        "transformers": save_lfm2(root / "hf"),
        "transformers_plain": save_lfm2(
            root / "plain",
            seed=1,
            conv_bias=True,
            tie_word_embeddings=False,
            block_auto_adjust_ff_dim=False,
            conv_L_cache=4,
            layer_types=["full_attention", "conv", "conv"],
            num_hidden_layers=3,
        ),
        "modelgen": make_checkpoint("lfm2", root / "gen", preset="tiny", seed=3),
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
    assert ours.config.layer_kinds == ("conv", "attention", "conv", "attention")
    assert ours.config.mlp_width == 96  # int(2 * 128 / 3) = 85, rounded up to a multiple of 32
    (conv,) = ours.state_spec().layers[0]
    assert (conv.name, conv.shape) == ("conv", (64, 2))
    assert ours.lm_head.is_tied
    plain, _ = models["transformers_plain"]
    assert plain.config.mlp_width == 128 and not plain.lm_head.is_tied
    assert plain.model.layers[1].conv.conv.bias is not None


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


def test_bad_layer_types_are_rejected() -> None:
    raw = {"vocab_size": 8, "hidden_size": 64, "num_hidden_layers": 2, "layer_types": ["conv", "mamba"]}
    with pytest.raises(ValueError, match="layer_types"):
        Lfm2Config.from_hf(raw)
