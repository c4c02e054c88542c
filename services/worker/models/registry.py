"""HF `architectures[0]` -> the model class that implements it."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Protocol

import torch

from himamba.services.worker.models.bamba import BambaForCausalLM
from himamba.services.worker.models.base import HybridModel
from himamba.services.worker.models.falcon_h1 import FalconH1ForCausalLM
from himamba.services.worker.models.granite_hybrid import GraniteHybridForCausalLM
from himamba.services.worker.models.jamba import JambaForCausalLM
from himamba.services.worker.models.lfm2 import Lfm2ForCausalLM
from himamba.services.worker.models.mamba2 import Mamba2ForCausalLM
from himamba.services.worker.models.nemotron_h import NemotronHForCausalLM
from himamba.services.worker.models.qwen3_next import Qwen3NextForCausalLM
from himamba.services.worker.models.zamba2 import Zamba2ForCausalLM


class ModelClass(Protocol):
    """What the loader needs of a model class: build it (uninitialised) from a raw config.json."""

    def from_hf_config(self, raw: Mapping[str, Any], device: torch.device | str, dtype: torch.dtype) -> HybridModel: ...


_ARCHITECTURES: Mapping[str, ModelClass] = MappingProxyType(
    {
        "NemotronHForCausalLM": NemotronHForCausalLM,
        "GraniteMoeHybridForCausalLM": GraniteHybridForCausalLM,
        "BambaForCausalLM": BambaForCausalLM,
        "FalconH1ForCausalLM": FalconH1ForCausalLM,
        "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
        "Mamba2ForCausalLM": Mamba2ForCausalLM,
        "Zamba2ForCausalLM": Zamba2ForCausalLM,
        "Lfm2ForCausalLM": Lfm2ForCausalLM,
        "JambaForCausalLM": JambaForCausalLM,
    }
)


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted(_ARCHITECTURES))


def model_class(architecture: str) -> ModelClass:
    """The class for an HF architecture name; ValueError listing the supported ones otherwise."""
    cls = _ARCHITECTURES.get(architecture)
    if cls is None:
        raise ValueError(
            f"architectures[0] {architecture!r} is not supported (supported: {', '.join(supported_architectures())})"
        )
    return cls


def architecture_of(raw_config: Mapping[str, Any]) -> str:
    """`architectures[0]` of a raw config.json dict (ValueError if absent or malformed)."""
    archs = raw_config.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ValueError(f"config.json field 'architectures' must be a non-empty list of names, got {archs!r}")
    return archs[0]
