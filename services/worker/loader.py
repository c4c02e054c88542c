"""Build a model from an HF checkpoint directory: config.json + *.safetensors -> HybridModel on a device."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType
from typing import TextIO

import torch
from safetensors import safe_open

from himamba.services.worker.layers.cpu_packing import pack_model
from himamba.services.worker.models.base import HybridModel
from himamba.services.worker.models.hf_config import read_config_json
from himamba.services.worker.models.registry import architecture_of, model_class
from himamba.services.worker.tensor_parallel import group

_DTYPES = MappingProxyType({"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16})
# Below this a checkpoint loads in about a second: no progress display unless asked for.
_LARGE_CHECKPOINT_BYTES = 256 * 1024 * 1024


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those of its index if it has one, else every `*.safetensors`."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: field 'weight_map' must be a non-empty object")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model_dir {model_dir} holds no *.safetensors file")
    for path in files:
        if not path.is_file():
            raise ValueError(f"checkpoint file listed in the index is missing: {path}")
    return files


def config_dtype(raw_config: dict) -> torch.dtype:
    """The checkpoint's dtype from config.json (`dtype`, or the older `torch_dtype`); float32 if absent."""
    name = raw_config.get("dtype") or raw_config.get("torch_dtype") or "float32"
    if name not in _DTYPES:
        raise ValueError(f"config.json field 'dtype' must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


class _Progress:
    """'loading weights i/n tensors' on a stream: rewritten in place on a terminal, a line a second otherwise."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self.total = total
        self.stream = stream
        self.is_tty = stream.isatty()
        self.last_s = 0.0

    def update(self, done: int) -> None:
        now = time.monotonic()
        final = done == self.total
        if not final and now - self.last_s < (0.1 if self.is_tty else 1.0):
            return
        self.last_s = now
        text = f"loading weights {done}/{self.total} tensors"
        if self.is_tty:
            self.stream.write("\r" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def _iter_tensors(files: list[Path], progress: _Progress | None) -> Iterator[tuple[str, torch.Tensor]]:
    done = 0
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
                done += 1
                if progress is not None:
                    progress.update(done)


def load_model(
    model_dir: Path | str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    progress: bool | None = None,
    progress_stream: TextIO | None = None,
    pack_cpu_weights: bool = True,
) -> HybridModel:
    """Read config.json, build the architecture's model on `device`/`dtype` and load every weight.

    dtype None takes the checkpoint's. `progress` None shows a progress display on stderr (or
    `progress_stream`) only for checkpoints over 256 MiB. `pack_cpu_weights`: on the CPU, projections
    run on oneDNN pre-packed copies of their weights (layers/cpu_packing.py). Raises ValueError for an unsupported
    architecture, a malformed config or missing/unexpected/mis-shaped weights.
    """
    model_dir = Path(model_dir)
    raw = read_config_json(model_dir)
    cls = model_class(architecture_of(raw))
    if group().size > 1 and not getattr(cls, "supports_tensor_parallel", False):
        raise ValueError(
            f"tensor parallelism: {architecture_of(raw)} is not sharded yet (NemotronH, Qwen3-Next, "
            "Granite-4.0-H, Bamba and Mamba2 are): serve it with --tensor-parallel-size 1"
        )
    model = cls.from_hf_config(raw, torch.device(device), dtype if dtype is not None else config_dtype(raw))
    files = checkpoint_files(model_dir)
    if progress is None:
        progress = sum(p.stat().st_size for p in files) >= _LARGE_CHECKPOINT_BYTES
    display = None
    if progress:
        total = 0
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                total += len(f.keys())
        display = _Progress(total, progress_stream or sys.stderr)
    model.load_weights(_iter_tensors(files, display))
    if pack_cpu_weights:
        pack_model(model)  # type: ignore[arg-type]  # every HybridModel is an nn.Module
    return model
