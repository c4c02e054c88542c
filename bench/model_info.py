"""What model a benchmark figure ran on (the machine: `himamba.bench.machine_info`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple


class ModelInfo(NamedTuple):
    """The checkpoint a figure was measured on; `line()` is how a benchmark states it."""

    path: str
    architecture: str
    preset: str  # "" for a user checkpoint
    hidden_size: int
    layers: str  # one letter per layer: M mamba, * attention, - mlp, E moe
    vocab_size: int
    dtype: str
    max_position_embeddings: int

    def line(self) -> str:
        preset = f" preset {self.preset}," if self.preset else ""
        return (
            f"model: {self.architecture},{preset} hidden {self.hidden_size}, layers {self.layers} "
            f"({len(self.layers)}), vocab {self.vocab_size}, {self.dtype}; {self.path}"
        )


_LAYER_LETTERS = {
    "mamba": "M", "linear_attention": "M", "M": "M",
    "attention": "*", "full_attention": "*", "*": "*",
    "mlp": "-", "-": "-",
    "moe": "E", "E": "E",
}  # fmt: skip


def _layer_pattern(cfg: dict[str, Any]) -> str:
    if isinstance(cfg.get("hybrid_override_pattern"), str):
        return cfg["hybrid_override_pattern"]
    kinds = cfg.get("layers_block_type") or cfg.get("layer_types") or []
    return "".join(_LAYER_LETTERS.get(k, "?") for k in kinds) or "?" * int(cfg.get("num_hidden_layers", 0))


def describe_model(model_dir: Path | str, preset: str, dtype: str) -> ModelInfo:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return ModelInfo(
        path=str(model_dir),
        architecture=(cfg.get("architectures") or [cfg.get("model_type", "?")])[0],
        preset=preset,
        hidden_size=int(cfg.get("hidden_size", 0)),
        layers=_layer_pattern(cfg),
        vocab_size=int(cfg.get("vocab_size", 0)),
        dtype=dtype,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 0)),
    )
