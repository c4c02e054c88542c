"""The safetensors loader: sharded checkpoints, dtype choice, progress display, strict weight accounting."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from himamba.services.modelgen.checkpoint import make_checkpoint
from himamba.services.worker.loader import load_model
from himamba.services.worker.models.hf_config import read_config_json
from himamba.services.worker.models.registry import model_class, supported_architectures
from tests.worker.harness import Harness


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("nemotron_h", tmp_path_factory.mktemp("loader") / "ckpt", preset="tiny", seed=1)


def _copy_with_weights(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _logits(model: object, ids: list[int]) -> torch.Tensor:
    harness = Harness(model)
    return harness.prefill([harness.new_sequence()], [ids])


def test_sharded_checkpoint_loads_like_a_single_file(checkpoint: Path, tmp_path: Path) -> None:
    tensors = load_file(str(checkpoint / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    dst = tmp_path / "sharded"
    shutil.copytree(checkpoint, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(dst / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    torch.testing.assert_close(_logits(load_model(dst), ids), _logits(load_model(checkpoint), ids), rtol=0, atol=0)


def test_dtype_override_builds_a_bfloat16_model(checkpoint: Path) -> None:
    model = load_model(checkpoint, dtype=torch.bfloat16)
    assert model.model.embeddings.weight.dtype == torch.bfloat16
    assert model.kv_spec().dtype == torch.bfloat16
    assert [c.dtype for c in model.state_spec().layers[0]] == [torch.bfloat16, torch.float32]
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    reference = _logits(load_model(checkpoint), ids)
    logits = _logits(model, ids)
    assert logits.dtype == torch.float32
    assert (logits - reference).abs().max().item() < 0.05 * reference.abs().max().item()


def test_progress_display_counts_tensors(checkpoint: Path) -> None:
    stream = io.StringIO()
    load_model(checkpoint, progress=True, progress_stream=stream)
    total = len(load_file(str(checkpoint / "model.safetensors")))
    lines = stream.getvalue().splitlines()
    assert lines[-1] == f"loading weights {total}/{total} tensors"


def test_small_checkpoint_shows_no_progress_by_default(checkpoint: Path) -> None:
    stream = io.StringIO()
    load_model(checkpoint, progress_stream=stream)
    assert stream.getvalue() == ""


def test_missing_weight_is_named(checkpoint: Path, tmp_path: Path) -> None:
    tensors = load_file(str(checkpoint / "model.safetensors"))
    del tensors["backbone.layers.0.mixer.A_log"]
    with pytest.raises(ValueError, match=r"missing weights: model\.layers\.0\.mixer\.A_log"):
        load_model(_copy_with_weights(checkpoint, tmp_path / "ckpt", tensors))


def test_missing_expert_row_is_named(checkpoint: Path, tmp_path: Path) -> None:
    tensors = load_file(str(checkpoint / "model.safetensors"))
    del tensors["backbone.layers.5.mixer.experts.2.down_proj.weight"]
    with pytest.raises(ValueError, match=r"missing weights: model\.layers\.5\.mixer\.experts\.down_proj"):
        load_model(_copy_with_weights(checkpoint, tmp_path / "ckpt", tensors))


def test_unexpected_weight_is_named(checkpoint: Path, tmp_path: Path) -> None:
    tensors = load_file(str(checkpoint / "model.safetensors"))
    tensors["backbone.layers.0.mixer.extra.weight"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"unexpected weights: backbone\.layers\.0\.mixer\.extra\.weight"):
        load_model(_copy_with_weights(checkpoint, tmp_path / "ckpt", tensors))


def test_misshapen_weight_is_named(checkpoint: Path, tmp_path: Path) -> None:
    tensors = load_file(str(checkpoint / "model.safetensors"))
    tensors["backbone.norm_f.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match=r"wrong shape: backbone\.norm_f\.weight"):
        load_model(_copy_with_weights(checkpoint, tmp_path / "ckpt", tensors))


def test_multi_token_prediction_weights_are_ignored(checkpoint: Path, tmp_path: Path) -> None:
    tensors = load_file(str(checkpoint / "model.safetensors"))
    tensors["mtp.layers.0.norm.weight"] = torch.ones(64)
    load_model(_copy_with_weights(checkpoint, tmp_path / "ckpt", tensors))


def _with_config(src: Path, dst: Path, tensors: dict[str, torch.Tensor], **changes: object) -> Path:
    _copy_with_weights(src, dst, tensors)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_nemotron_h_tied_config_uses_a_saved_head_else_the_embeddings(checkpoint: Path, tmp_path: Path) -> None:
    tensors = load_file(str(checkpoint / "model.safetensors"))
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    # transformers saves and uses lm_head.weight even when the config says tied.
    with_head = load_model(_with_config(checkpoint, tmp_path / "a", tensors, tie_word_embeddings=True))
    torch.testing.assert_close(_logits(with_head, ids), _logits(load_model(checkpoint), ids), rtol=0, atol=0)
    headless = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    tied = load_model(_with_config(checkpoint, tmp_path / "b", headless, tie_word_embeddings=True))
    assert tied.lm_head.is_tied
    explicit = dict(tensors, **{"lm_head.weight": tensors["backbone.embeddings.weight"].clone()})
    untied = load_model(_with_config(checkpoint, tmp_path / "c", explicit))
    torch.testing.assert_close(_logits(tied, ids), _logits(untied, ids), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"missing weights: lm_head\.weight"):
        load_model(_with_config(checkpoint, tmp_path / "d", headless))


def test_unsupported_architecture_is_rejected(checkpoint: Path, tmp_path: Path) -> None:
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoint, dst)
    config = json.loads((dst / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        load_model(dst)


def test_registry_knows_every_family() -> None:
    assert supported_architectures() == (
        "BambaForCausalLM",
        "FalconH1ForCausalLM",
        "GraniteMoeHybridForCausalLM",
        "JambaForCausalLM",
        "Lfm2ForCausalLM",
        "Mamba2ForCausalLM",
        "NemotronHForCausalLM",
        "Qwen3NextForCausalLM",
        "Zamba2ForCausalLM",
    )
    with pytest.raises(ValueError, match="supported"):
        model_class("RwkvForCausalLM")


def test_config_reader_decodes_tagged_and_bare_infinity(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"a": [0.0, {"__float__": "Infinity"}], "b": Infinity}')
    raw = read_config_json(tmp_path)
    assert raw["a"] == [0.0, float("inf")] and raw["b"] == float("inf")
