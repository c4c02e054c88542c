"""make_checkpoint for the issue-8 families (`himamba make-model --arch ...`): the config is what
transformers writes, transformers loads every tensor (no missing, unexpected or mis-shaped one), and
the same seed gives the same weights. Parity of the loaded models is in tests/worker/test_*_parity.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from himamba.services.cli import main
from himamba.services.modelgen.checkpoint import ARCHS, make_checkpoint
from himamba.services.modelgen.family_configs import FAMILY_CONFIGS
from tests.modelgen.layer_names import with_newer_names

FAMILIES = tuple(FAMILY_CONFIGS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("family_ckpt")
    out = {}
    for arch in FAMILIES:
        assert main(["make-model", "--arch", arch, "--out", str(root / arch), "--seed", "2"]) == 0
        out[arch] = root / arch
    return out


def test_every_family_is_a_make_model_arch() -> None:
    assert set(FAMILIES) == {"bamba", "falcon_h1", "qwen3_next", "mamba2", "zamba2", "lfm2", "jamba"}
    assert set(FAMILIES) <= set(ARCHS)


@pytest.mark.parametrize("arch", FAMILIES)
def test_transformers_loads_every_weight(checkpoints: dict[str, Path], arch: str) -> None:
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(checkpoints[arch], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


@pytest.mark.parametrize("arch", FAMILIES)
def test_config_matches_what_transformers_writes(checkpoints: dict[str, Path], arch: str, tmp_path: Path) -> None:
    from transformers import AutoConfig

    ours = json.loads((checkpoints[arch] / "config.json").read_text())
    AutoConfig.from_pretrained(checkpoints[arch]).save_pretrained(tmp_path)
    assert with_newer_names(ours) == json.loads((tmp_path / "config.json").read_text())


def test_the_seed_decides_the_weights(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    again = load_file(str(make_checkpoint("jamba", tmp_path / "again", seed=2) / "model.safetensors"))
    other = load_file(str(make_checkpoint("jamba", tmp_path / "other", seed=3) / "model.safetensors"))
    first = load_file(str(checkpoints["jamba"] / "model.safetensors"))
    assert first.keys() == again.keys() == other.keys()
    assert all(first[k].equal(again[k]) for k in first)
    assert not first["model.layers.0.mamba.in_proj.weight"].equal(other["model.layers.0.mamba.in_proj.weight"])


def test_only_the_tiny_preset_exists_for_the_new_families(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="preset"):
        make_checkpoint("lfm2", tmp_path / "x", preset="medium")
