"""Jamba against transformers (prefill logits, greedy generation) for a transformers-saved checkpoint
(Mamba1 with inner norms, per-expert MoE layout) and our checkpoint maker's (stacked experts);
batching and prefix-cache behaviour with Mamba1 states."""

from __future__ import annotations

import pytest
import torch

from himamba.services.worker.models.jamba import JambaConfig
from tests.worker import family_checks as checks

SOURCES = ("transformers", "transformers_tied", "modelgen")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, object]]:
    paths = checks.family_checkpoints(
        tmp_path_factory.mktemp("jamba"),
        "jamba",
        "Jamba",
        "transformers_tied",
        tie_word_embeddings=True,
        mamba_conv_bias=False,
        mamba_proj_bias=True,
        attn_layer_offset=0,
        num_hidden_layers=3,
        num_experts_per_tok=1,
    )
    return checks.load_sources(paths)


test_prefill_logits_match_transformers = checks.prefill_parity_test(SOURCES)
test_greedy_generation_matches_transformers = checks.greedy_parity_test(SOURCES)


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


test_cache_behaviour = checks.cache_behaviour_test()


def test_bad_layer_offsets_are_rejected() -> None:
    with pytest.raises(ValueError, match="attn_layer_offset"):
        JambaConfig.from_hf({"vocab_size": 8, "hidden_size": 64, "attn_layer_period": 2, "attn_layer_offset": 2})
