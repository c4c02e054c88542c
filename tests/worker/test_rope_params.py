"""Rope settings read from config.json: the scaled types transformers computes at load are reproduced
bit for bit (checked against transformers' own ROPE_INIT_FUNCTIONS), the batch-dependent ones are
refused by name, and a type's missing parameter is named."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from himamba.services.worker.models.hf_config import ConfigFields
from himamba.services.worker.models.rope_params import rope_settings

CASES = (
    {"rope_type": "linear", "factor": 2.5},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.7,
     "mscale_all_dim": 0.9, "beta_fast": 8.0, "beta_slow": 2.0, "truncate": False},
)  # fmt: skip


@pytest.mark.parametrize("params", CASES, ids=lambda p: p["rope_type"] + str(len(p)))
def test_scaled_frequencies_equal_transformers(params: dict[str, Any]) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = {"hidden_size": 128, "num_attention_heads": 4, "max_position_embeddings": 512}
    rope = {"rope_theta": 5000.0, **params}
    expected, expected_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](
        LlamaConfig(**raw, rope_parameters=dict(rope)), "cpu"
    )
    settings = rope_settings(ConfigFields(raw | {"rope_parameters": rope}, "Test"), default_theta=10000.0)
    inv_freq, scale = settings.frequencies(32)
    assert torch.equal(inv_freq, expected.float()) and scale == pytest.approx(expected_scale, rel=1e-12)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "made_up"])
def test_batch_dependent_and_unknown_types_are_refused_by_name(rope_type: str) -> None:
    f = ConfigFields({"rope_parameters": {"rope_type": rope_type, "factor": 2.0}}, "Test")
    with pytest.raises(ValueError, match=rope_type):
        rope_settings(f, default_theta=10000.0)


def test_a_missing_parameter_is_named() -> None:
    f = ConfigFields({"rope_parameters": {"rope_type": "llama3", "factor": 2.0}}, "Test")
    with pytest.raises(ValueError, match="low_freq_factor"):
        rope_settings(f, default_theta=10000.0)


def test_partial_rotary_factor_only_where_the_family_reads_it() -> None:
    raw = {"rope_parameters": {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5}}
    assert rope_settings(ConfigFields(raw, "T"), 1.0).partial_rotary_factor == 0.5
    assert rope_settings(ConfigFields(raw, "T"), 1.0, reads_partial=False).partial_rotary_factor == 1.0
