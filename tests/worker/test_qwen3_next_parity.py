"""Qwen3-Next against transformers (prefill logits, greedy generation) for a transformers-saved
checkpoint (per-expert MoE layout, a dense layer, Hv = 2 Hk) and our checkpoint maker's (stacked
experts); batching and prefix-cache behaviour; the per-expert layout's errors."""

from __future__ import annotations

import pytest
import torch

from himamba.services.worker.models.expert_weights import merge_expert_weights
from tests.worker import family_checks as checks

SOURCES = ("transformers", "transformers_tied", "modelgen")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, object]]:
    paths = checks.family_checkpoints(
        tmp_path_factory.mktemp("qwen3_next"),
        "qwen3_next",
        "Qwen3Next",
        "transformers_tied",
        tie_word_embeddings=True,
        norm_topk_prob=False,
        attention_bias=True,
        num_hidden_layers=2,
        layer_types=["full_attention", "linear_attention"],
        mlp_only_layers=[],
        linear_num_value_heads=2,
    )
    return checks.load_sources(paths)


test_prefill_logits_match_transformers = checks.prefill_parity_test(SOURCES)
test_greedy_generation_matches_transformers = checks.greedy_parity_test(SOURCES)


def test_the_model_is_what_the_config_says(models: dict) -> None:
    ours, _ = models["transformers"]
    assert ours.config.layer_kinds == ("linear", "attention", "linear", "attention")
    assert ours.config.moe_layers == (True, True, False, True)
    assert ours.config.rope.partial_rotary_factor == 0.25
    conv, recurrent = ours.state_spec().layers[0]
    assert (conv.name, conv.shape) == ("conv", (2 * 2 * 16 + 4 * 16, 3))
    assert (recurrent.name, recurrent.shape, recurrent.dtype) == ("recurrent", (4, 16, 16), torch.float32)
    tied, _ = models["transformers_tied"]
    assert tied.lm_head.is_tied and not tied.config.norm_topk_prob


test_cache_behaviour = checks.cache_behaviour_test()


def test_per_expert_gate_and_up_are_stacked_gate_first() -> None:
    gate, up, down = torch.ones(2, 3), torch.zeros(2, 3), torch.full((3, 2), 5.0)
    merged = dict(
        merge_expert_weights(
            [
                ("m.experts.1.up_proj.weight", up),
                ("m.experts.1.down_proj.weight", down),
                ("x.weight", up),
                ("m.experts.1.gate_proj.weight", gate),
            ]
        )
    )
    assert set(merged) == {"m.experts.down_proj[1]", "x.weight", "m.experts.gate_up_proj[1]"}
    assert torch.equal(merged["m.experts.gate_up_proj[1]"], torch.cat((gate, up)))


def test_an_unpaired_expert_half_is_named() -> None:
    with pytest.raises(ValueError, match=r"m\.experts\.0\.up_proj\.weight"):
        list(merge_expert_weights([("m.experts.0.gate_proj.weight", torch.ones(2, 3))]))
