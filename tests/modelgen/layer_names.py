"""Layer-type names: the older ones make-model writes (every transformers release since 5.12 reads them)
and the newer ones transformers 5.23 writes back."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

# 5.23 maps the older names onto these when it loads a config (configuration_utils.remap_legacy_layer_types).
_NEWER = MappingProxyType({"mamba": "linear_attention", "attention": "full_attention"})
LAYER_KEYS = ("layers_block_type", "layer_types", "mtp_layers_block_type")


def with_newer_names(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with its layer-type lists spelled as transformers 5.23 writes them."""
    return config | {k: [_NEWER.get(n, n) for n in config[k]] for k in LAYER_KEYS if k in config}
