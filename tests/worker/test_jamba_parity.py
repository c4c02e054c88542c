"""Jamba against transformers (prefill logits, greedy generation) for a transformers-saved checkpoint
(Mamba1 with inner norms, per-expert MoE layout) and our checkpoint maker's (stacked experts);
batching and prefix-cache behaviour with Mamba1 states."""

from __future__ import annotations

import pytest
import torch

from himamba.services.modelgen.checkpoint import make_checkpoint
from himamba.services.worker.loader import load_model
from himamba.services.worker.models.jamba import JambaConfig
from tests.worker import family_checks as checks
from tests.worker.hf_reference import load_reference
from tests.worker.hf_reference_more import save_jamba

PROMPT_LENGTHS = (1, 7, 64, 300, 700)
SOURCES = ("transformers", "transformers_tied", "modelgen")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, object]]:
    root = tmp_path_factory.mktemp("jamba")
    paths = {
        "transformers": save_jamba(root / "hf"),
        "transformers_tied": save_jamba(
            root / "tied",
            seed=1,
            tie_word_embeddings=True,
            mamba_conv_bias=False,
            mamba_proj_bias=True,
            attn_layer_offset=0,
            num_hidden_layers=3,
            num_experts_per_tok=1,
        ),
        "modelgen": make_checkpoint("jamba", root / "gen", preset="tiny", seed=3),
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
    assert ours.config.layer_kinds == ("mamba", "mamba", "attention", "mamba")
    assert ours.config.moe_layers == (False, True, False, True)
    assert ours.config.mamba_dt_rank == 2
    conv, ssm = ours.state_spec().layers[0]
    assert (conv.name, conv.shape) == ("conv", (64, 3))
    assert (ssm.name, ssm.shape, ssm.dtype) == ("ssm", (64, 8), torch.float32)
    tied, _ = models["transformers_tied"]
    assert tied.lm_head.is_tied and tied.model.layers[1].mamba.in_proj.bias is not None


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


def test_bad_layer_offsets_are_rejected() -> None:
    with pytest.raises(ValueError, match="attn_layer_offset"):
        JambaConfig.from_hf({"vocab_size": 8, "hidden_size": 64, "attn_layer_period": 2, "attn_layer_offset": 2})
