"""`make_checkpoint`: a complete HF-format model directory with random weights and the demo tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType
from typing import Any

from safetensors.torch import save_file

from himamba.services.modelgen.family_configs import FAMILY_CONFIGS, family_config
from himamba.services.modelgen.family_weights import FAMILY_PARAMS
from himamba.services.modelgen.hf_configs import generation_config, granite_hybrid_config, nemotron_h_config
from himamba.services.modelgen.tokenizer_files import train_demo_tokenizer
from himamba.services.modelgen.weights import granite_hybrid_params, nemotron_h_params, random_weights

ARCHS = ("nemotron_h", "granite_hybrid", *FAMILY_CONFIGS)
# Tokenizer (and so model) vocabulary per preset.
_VOCAB = MappingProxyType({"tiny": 2048, "medium": 8192})


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def make_checkpoint(arch: str, out_dir: Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Write config.json, model.safetensors, tokenizer.json, tokenizer_config.json and
    generation_config.json into `out_dir` (created if needed); returns `out_dir`.

    arch: "nemotron_h" (presets "tiny", "medium"), or preset "tiny" of "granite_hybrid", "bamba",
    "falcon_h1", "qwen3_next", "mamba2", "zamba2", "lfm2", "jamba".
    The same (arch, preset, seed) always gives the same files. The directory loads with
    transformers' `from_pretrained` and with `himamba.services.worker.loader.load_model`.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if preset not in _VOCAB:
        raise ValueError(f"preset must be one of {tuple(_VOCAB)}, got {preset!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Validate the preset before spending a second on the tokenizer.
    if arch == "nemotron_h":
        nemotron_h_config(preset, _VOCAB[preset])
    elif arch == "granite_hybrid":
        granite_hybrid_config(preset, _VOCAB[preset])
    elif preset != "tiny":
        raise ValueError(f"preset must be 'tiny' for {arch}, got {preset!r}")
    train_demo_tokenizer(out_dir, vocab_size=_VOCAB[preset])
    vocab = _tokenizer_vocab_size(out_dir)
    if arch == "nemotron_h":
        config = nemotron_h_config(preset, vocab)
        specs = nemotron_h_params(config)
    elif arch == "granite_hybrid":
        config = granite_hybrid_config(preset, vocab)
        specs = granite_hybrid_params(config)
    else:
        config = family_config(arch, vocab)
        specs = FAMILY_PARAMS[arch](config)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", generation_config(config))
    tensors = random_weights(specs, seed)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    # Marks the weights as random so a server can say so loudly.
    _write_json(out_dir / "himamba.json", {"random_weights": True, "arch": arch, "preset": preset, "seed": seed})
    return out_dir


def _tokenizer_vocab_size(out_dir: Path) -> int:
    """Vocabulary size of the written tokenizer.json (BPE vocab plus any added tokens)."""
    data = json.loads((out_dir / "tokenizer.json").read_text())
    ids = set(data["model"]["vocab"].values()) | {t["id"] for t in data.get("added_tokens", [])}
    return max(ids) + 1
