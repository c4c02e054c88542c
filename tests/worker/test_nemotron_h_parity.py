"""NemotronH against transformers: prefill logits and greedy generation, for checkpoints saved by
transformers and made by our checkpoint maker, and for the published config spellings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from himamba.services.modelgen.checkpoint import make_checkpoint
from himamba.services.worker.loader import load_model
from himamba.services.worker.models.nemotron_h import NemotronHConfig, NemotronHForCausalLM
from tests.worker import family_checks as checks
from tests.worker.harness import Harness
from tests.worker.hf_reference import greedy, last_logits, save_nemotron_h


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("nemotron_h")
    return {
        "transformers": save_nemotron_h(root / "hf"),
        "modelgen": make_checkpoint("nemotron_h", root / "gen", preset="tiny", seed=3),
    }


@pytest.fixture(scope="module")
def models(checkpoints: dict[str, Path]) -> dict[str, tuple[NemotronHForCausalLM, object]]:
    return checks.load_sources(checkpoints)


test_prefill_logits_match_transformers = checks.prefill_parity_test(("transformers", "modelgen"))


@pytest.mark.parametrize("source", ["transformers", "modelgen"])
def test_greedy_generation_matches_transformers(models: dict, source: str) -> None:
    ours, ref = models[source]
    ids = checks.prompt(ours.vocab_size, 40, seed=11)
    expected = greedy(ref, ids, 32)
    assert Harness(ours).generate_greedy([ids], 32) == [expected]


def test_every_layer_kind_is_exercised(models: dict) -> None:
    ours, _ = models["transformers"]
    assert set(ours.config.layer_kinds) == {"mamba", "attention", "mlp", "moe"}
    assert ours.kv_spec().num_layers == 2
    assert ours.state_spec().num_layers == 2
    conv, ssm = ours.state_spec().layers[0]
    assert (conv.name, conv.shape, conv.dtype) == ("conv", (8 * 16 + 2 * 2 * 16, 3), torch.float32)
    assert (ssm.name, ssm.shape, ssm.dtype) == ("ssm", (8, 16, 16), torch.float32)


def _respell(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _published_pattern(config: dict) -> None:
    codes = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
    config["hybrid_override_pattern"] = "".join(codes[k] for k in config.pop("layers_block_type"))
    config["num_hidden_layers"] = len(config["hybrid_override_pattern"])
    for new, old in (
        ("n_groups", "mamba_n_groups"),
        ("conv_kernel", "mamba_d_conv"),
        ("chunk_size", "mamba_chunk_size"),
    ):
        config[old] = config.pop(new)


def _old_names(config: dict) -> None:
    old = {"linear_attention": "mamba", "full_attention": "attention"}
    config["layers_block_type"] = [old.get(k, k) for k in config["layers_block_type"]]


@pytest.mark.parametrize("edit", [_published_pattern, _old_names], ids=["hybrid_override_pattern", "old_layer_names"])
def test_published_config_spellings_load_the_same_model(
    checkpoints: dict[str, Path], models: dict, tmp_path: Path, edit
) -> None:
    original, ref = models["transformers"]
    respelled = load_model(_respell(checkpoints["transformers"], tmp_path / "ckpt", edit))
    assert respelled.config == original.config
    ids = checks.prompt(original.vocab_size, 20, seed=5)
    harness = Harness(respelled)
    logits = harness.prefill([harness.new_sequence()], [ids])
    assert (logits[0] - last_logits(ref, ids)).abs().max().item() < 1e-4


def test_unknown_layer_type_is_rejected() -> None:
    with pytest.raises(ValueError, match="hybrid_override_pattern"):
        NemotronHConfig.from_hf({"vocab_size": 8, "hidden_size": 8, "hybrid_override_pattern": "M*X"})
