"""make_checkpoint: the files transformers expects, loadable by transformers and by our loader,
deterministic in the seed, and with weights that give non-degenerate outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from himamba.services.modelgen.checkpoint import make_checkpoint
from himamba.services.modelgen.hf_configs import nemotron_h_config
from himamba.services.modelgen.weights import nemotron_h_params
from himamba.services.worker.loader import load_model
from tests.modelgen.layer_names import with_newer_names
from tests.worker.harness import Harness

ARCHS = ("nemotron_h", "granite_hybrid")
FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "himamba.json"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: make_checkpoint(arch, root / arch, preset="tiny", seed=0) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_directory_has_every_file(checkpoints: dict[str, Path], arch: str) -> None:
    assert {p.name for p in checkpoints[arch].iterdir()} == FILES
    generation = json.loads((checkpoints[arch] / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_every_weight(checkpoints: dict[str, Path], arch: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoints[arch])
    assert config.vocab_size == 2048
    _, info = AutoModelForCausalLM.from_pretrained(checkpoints[arch], output_loading_info=True)
    assert not info["missing_keys"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"]


@pytest.mark.parametrize("arch", ARCHS)
def test_config_matches_what_transformers_writes(checkpoints: dict[str, Path], arch: str, tmp_path: Path) -> None:
    from transformers import AutoConfig

    ours = json.loads((checkpoints[arch] / "config.json").read_text())
    AutoConfig.from_pretrained(checkpoints[arch]).save_pretrained(tmp_path)
    theirs = json.loads((tmp_path / "config.json").read_text())
    assert with_newer_names(ours) == theirs


@pytest.mark.parametrize("arch", ARCHS)
def test_generation_config_matches_what_transformers_writes(
    checkpoints: dict[str, Path], arch: str, tmp_path: Path
) -> None:
    """save_pretrained writes a generation_config.json derived from the model config (what a
    model's generation_config starts as): ours is that file, so it recommends no sampling values."""
    from transformers import AutoConfig, GenerationConfig

    ours = json.loads((checkpoints[arch] / "generation_config.json").read_text())
    GenerationConfig.from_model_config(AutoConfig.from_pretrained(checkpoints[arch])).save_pretrained(tmp_path)
    assert ours == json.loads((tmp_path / "generation_config.json").read_text())
    assert not {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens"} & set(ours)


def test_greedy_outputs_are_not_degenerate(checkpoints: dict[str, Path]) -> None:
    from tokenizers import Tokenizer

    for arch in ARCHS:
        tok = Tokenizer.from_file(str(checkpoints[arch] / "tokenizer.json"))
        model = load_model(checkpoints[arch])
        prompts = ["import os\n", "def main():", "class Point:\n    x: int", "# a comment"]
        outputs = Harness(model).generate_greedy([tok.encode(p).ids for p in prompts], 12)
        assert len({tuple(o) for o in outputs}) == len(prompts), arch
        assert all(len(set(o)) > 1 for o in outputs), arch


def test_same_seed_same_bytes_other_seed_other_weights(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    again = make_checkpoint("granite_hybrid", tmp_path / "again", seed=0)
    other = make_checkpoint("granite_hybrid", tmp_path / "other", seed=1)
    original = checkpoints["granite_hybrid"]
    for name in FILES:
        assert (again / name).read_bytes() == (original / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (original / "model.safetensors").read_bytes()


def test_medium_nemotron_h_is_about_20m_parameters() -> None:
    config = nemotron_h_config("medium", 8192)
    assert (
        "".join({"mamba": "M", "mlp": "-", "attention": "*"}[k] for k in config["layers_block_type"])
        == "M-M*M-M*"
    )
    params = sum(torch.Size(spec.shape).numel() for spec in nemotron_h_params(config))
    assert 15_000_000 < params < 25_000_000


@pytest.mark.parametrize(("arch", "preset"), [("rwkv7", "tiny"), ("granite_hybrid", "medium"), ("nemotron_h", "huge")])
def test_unknown_arch_or_preset_is_rejected(tmp_path: Path, arch: str, preset: str) -> None:
    with pytest.raises(ValueError, match="arch|preset"):
        make_checkpoint(arch, tmp_path, preset=preset)
