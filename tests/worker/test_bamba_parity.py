"""Bamba against transformers (prefill logits, greedy generation) for a transformers-saved checkpoint
(partial rope, GQA, two Mamba2 groups) and our checkpoint maker's; batching and prefix-cache behaviour."""

from __future__ import annotations

import pytest

from himamba.services.modelgen.checkpoint import make_checkpoint
from himamba.services.worker.loader import load_model
from himamba.services.worker.models.bamba import BambaConfig
from tests.worker import family_checks as checks
from tests.worker.hf_reference import load_reference
from tests.worker.hf_reference_more import save_bamba

PROMPT_LENGTHS = (1, 7, 64, 300, 700)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, object]]:
    root = tmp_path_factory.mktemp("bamba")
    paths = {
        "transformers": save_bamba(root / "hf"),
        "transformers_tied": save_bamba(
            root / "tied",
            seed=1,
            tie_word_embeddings=True,
            attention_bias=True,
            attn_layer_indices=[0],
            num_hidden_layers=2,
            mlp_bias=True,
        ),
        "modelgen": make_checkpoint("bamba", root / "gen", preset="tiny", seed=3),
    }
    return {name: (load_model(path), load_reference(path)) for name, path in paths.items()}


@pytest.mark.parametrize("source", ["transformers", "transformers_tied", "modelgen"])
def test_prefill_logits_match_transformers(models: dict, source: str) -> None:
    ours, ref = models[source]
    checks.assert_prefill_parity(ours, ref, PROMPT_LENGTHS)


@pytest.mark.parametrize("source", ["transformers", "modelgen"])
def test_greedy_generation_matches_transformers(models: dict, source: str) -> None:
    ours, ref = models[source]
    checks.assert_greedy_parity(ours, ref, PROMPT_LENGTHS)


def test_the_model_is_what_the_config_says(models: dict) -> None:
    ours, _ = models["transformers"]
    assert ours.config.layer_kinds == ("mamba", "attention", "mamba", "attention")
    assert ours.config.rope.partial_rotary_factor == 0.5
    assert ours.kv_spec().num_layers == 2 and ours.state_spec().num_layers == 2
    tied, _ = models["transformers_tied"]
    assert tied.lm_head.is_tied and tied.model.layers[0].self_attn.q_proj.bias is not None


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


def test_bad_attention_indices_are_rejected() -> None:
    with pytest.raises(ValueError, match="attn_layer_indices"):
        BambaConfig.from_hf({"vocab_size": 8, "hidden_size": 64, "num_hidden_layers": 2, "attn_layer_indices": [5]})
