"""Qwen3-Next against transformers (prefill logits, greedy generation) for a transformers-saved
checkpoint (per-expert MoE layout, a dense layer, Hv = 2 Hk) and our checkpoint maker's (stacked
experts); batching and prefix-cache behaviour; the per-expert layout's errors."""

from __future__ import annotations

import pytest
import torch

from himamba.services.modelgen.checkpoint import make_checkpoint
from himamba.services.worker.loader import load_model
from himamba.services.worker.models.expert_weights import merge_expert_weights
from tests.worker import family_checks as checks
from tests.worker.hf_reference import load_reference
from tests.worker.hf_reference_more import save_qwen3_next

PROMPT_LENGTHS = (1, 7, 64, 300, 700)
SOURCES = ("transformers", "transformers_tied", "modelgen")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, object]]:
    root = tmp_path_factory.mktemp("qwen3_next")
    paths = {
        "transformers": save_qwen3_next(root / "hf"),
        "transformers_tied": save_qwen3_next(
            root / "tied",
            seed=1,
            tie_word_embeddings=True,
            norm_topk_prob=False,
            attention_bias=True,
            num_hidden_layers=2,
            layer_types=["full_attention", "linear_attention"],
            mlp_only_layers=[],
            linear_num_value_heads=2,
        ),
        "modelgen": make_checkpoint("qwen3_next", root / "gen", preset="tiny", seed=3),
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
    assert ours.config.layer_kinds == ("linear", "attention", "linear", "attention")
    assert ours.config.moe_layers == (True, True, False, True)
    assert ours.config.rope.partial_rotary_factor == 0.25
    conv, recurrent = ours.state_spec().layers[0]
    assert (conv.name, conv.shape) == ("conv", (2 * 2 * 16 + 4 * 16, 3))
    assert (recurrent.name, recurrent.shape, recurrent.dtype) == ("recurrent", (4, 16, 16), torch.float32)
    tied, _ = models["transformers_tied"]
    assert tied.lm_head.is_tied and not tied.config.norm_topk_prob


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
