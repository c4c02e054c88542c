"""What a benchmark figure ran on: the machine and the model configuration."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any, NamedTuple


class MachineInfo(NamedTuple):
    cores: int
    torch_threads: int  # per server worker, as resolved (0 on the command line = torch's default)
    device: str
    cpu_model: str
    gpu_model: str
    torch_version: str

    def line(self) -> str:
        gpu = f", {self.gpu_model}" if self.gpu_model else ""
        return (
            f"machine: {self.cores} cores ({self.cpu_model}), torch {self.torch_version} with {self.torch_threads} "
            f"thread(s) per worker, device {self.device}{gpu}"
        )


class ModelInfo(NamedTuple):
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


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_machine(torch_threads: int, device: str) -> MachineInfo:
    """`torch_threads` as given to the server (0: torch's default on this machine)."""
    import torch  # only to resolve the default thread count and name the GPU

    threads = torch_threads or torch.get_num_threads()
    gpu = ""
    if device == "cuda" and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
    return MachineInfo(
        cores=os.cpu_count() or 0,
        torch_threads=threads,
        device=device,
        cpu_model=_cpu_model(),
        gpu_model=gpu,
        torch_version=torch.__version__,
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
