"""Zamba2 against transformers (prefill logits, greedy generation) for a transformers-saved checkpoint
(two shared blocks used at three depths, adapters, rope), a variant (one block, no attention adapters,
no rope, GQA) and our checkpoint maker's; batching and prefix-cache behaviour; shared weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from himamba.services.worker.loader import load_model
from himamba.services.worker.models.zamba2 import Zamba2Config
from tests.worker import family_checks as checks
from tests.worker.harness import Harness
from tests.worker.hf_reference import last_logits

SOURCES = ("transformers", "transformers_plain", "modelgen")


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return checks.family_checkpoints(
        tmp_path_factory.mktemp("zamba2"),
        "zamba2",
        "Zamba2",
        "transformers_plain",
        num_mem_blocks=1,
        use_shared_attention_adapter=False,
        use_mem_rope=False,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        hidden_act="silu",
        layers_block_type=["hybrid", "mamba", "hybrid"],
        num_hidden_layers=3,
    )


@pytest.fixture(scope="module")
def models(paths: dict[str, Path]) -> dict[str, tuple[object, object]]:
    return checks.load_sources(paths)


test_prefill_logits_match_transformers = checks.prefill_parity_test(SOURCES)
test_greedy_generation_matches_transformers = checks.greedy_parity_test(SOURCES)


def test_shared_blocks_have_one_weight_and_one_kv_layer_per_use(models: dict) -> None:
    ours, _ = models["transformers"]
    assert len(ours.model.blocks) == 2
    assert [(layer.block, layer.use) for layer in ours.model.layers if hasattr(layer, "use")] == [
        (0, 0),
        (1, 1),
        (0, 2),
    ]
    assert ours.kv_spec().num_layers == 3 and ours.kv_spec().head_dim == 32
    assert ours.state_spec().num_layers == 6
    assert set(ours.model.blocks[0].feed_forward.gate_up_proj_adapter_list) == {"0", "2"}


def test_a_checkpoint_repeating_the_shared_block_loads(paths: dict[str, Path], models: dict, tmp_path: Path) -> None:
    """Older Zamba2 files store the shared block again under every layer that uses it."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst = tmp_path / "repeated"
    shutil.copytree(paths["transformers"], dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for name in [n for n in tensors if n.startswith("model.layers.1.shared_transformer.")]:
        tensors[name.replace("layers.1.", "layers.5.")] = tensors[name].clone()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    ours = load_model(dst)
    ids = checks.prompt(ours.vocab_size, 30, seed=9)
    harness = Harness(ours)
    logits = harness.prefill([harness.new_sequence()], [ids])
    assert (logits[0] - last_logits(models["transformers"][1], ids)).abs().max().item() < checks.LOGIT_TOL


test_cache_behaviour = checks.cache_behaviour_test()


def test_untied_blocks_are_per_layer_as_in_transformers(models: dict) -> None:
    plain, _ = models["transformers_plain"]
    assert not plain.lm_head.is_tied
    assert [(layer.block, layer.use) for layer in plain.model.layers if hasattr(layer, "use")] == [(0, 0), (1, 1)]


def test_unknown_layer_kind_is_rejected() -> None:
    raw = {"vocab_size": 8, "hidden_size": 64, "num_hidden_layers": 2, "layers_block_type": ["mamba", "moe"]}
    with pytest.raises(ValueError, match="layers_block_type"):
        Zamba2Config.from_hf(raw)


def test_attention_adapters_with_grouped_kv_are_rejected() -> None:
    raw = {
        "vocab_size": 8,
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "layers_block_type": ["hybrid"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "use_shared_attention_adapter": True,
    }
    with pytest.raises(ValueError, match="use_shared_attention_adapter"):
        Zamba2Config.from_hf(raw)
