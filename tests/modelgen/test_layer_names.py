"""make-model writes the layer-type names every transformers release since 5.12 reads (sglang pins
5.12, and its bench_serving loads the checkpoint's config through AutoConfig): 5.12's NemotronH config
rejects "linear_attention" / "full_attention", which 5.23 writes. Installed transformers (5.23) loading
the older names is tested in test_checkpoint.py / test_family_checkpoints.py."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from himamba.services.modelgen.family_configs import FAMILY_CONFIGS, family_config
from himamba.services.modelgen.hf_configs import granite_hybrid_config, nemotron_h_config
from tests.modelgen.layer_names import LAYER_KEYS

# What transformers 5.12.0's config classes accept (read from its configuration_*.py):
# NemotronHConfig.validate_layer_type; Zamba2's modeling tells "mamba" from "hybrid"; the others
# go through PreTrainedConfig.validate_layer_type (ALLOWED_LAYER_TYPES), Granite's modeling tests "mamba".
ACCEPTED_BY_5_12 = MappingProxyType(
    {
        "nemotron_h": frozenset({"mamba", "attention", "moe", "mlp"}),
        "granite_hybrid": frozenset({"mamba", "attention"}),
        "zamba2": frozenset({"mamba", "hybrid"}),
        "qwen3_next": frozenset({"linear_attention", "full_attention"}),
        "lfm2": frozenset({"conv", "full_attention"}),
    }
)


def _configs() -> list[tuple[str, dict]]:
    out = [
        ("nemotron_h/tiny", nemotron_h_config("tiny", 2048)),
        ("nemotron_h/medium", nemotron_h_config("medium", 8192)),
        ("granite_hybrid/tiny", granite_hybrid_config("tiny", 2048)),
    ]
    return out + [(f"{arch}/tiny", family_config(arch, 2048)) for arch in FAMILY_CONFIGS]


@pytest.mark.parametrize(("name", "config"), _configs(), ids=[n for n, _ in _configs()])
def test_written_layer_names_are_ones_transformers_5_12_accepts(name: str, config: dict) -> None:
    arch = name.split("/")[0]
    lists = {k: config[k] for k in LAYER_KEYS if k in config}
    if arch not in ACCEPTED_BY_5_12:
        assert not lists, f"{name} writes layer types {lists}: add its 5.12 names here"
        return
    assert lists
    for key, names in lists.items():
        assert set(names) <= ACCEPTED_BY_5_12[arch], f"{name}: {key} = {names}"
