"""Bamba (`BambaForCausalLM`): Mamba2 or attention, then a SwiGLU MLP, per layer.

Matches transformers 5.23's modeling_bamba: each layer is `h += mixer(input_layernorm(h))` then
`h += feed_forward(pre_ff_layernorm(h))`; attention layers are those in `attn_layer_indices`, with
rope over the first half of each head (`partial_rotary_factor` 0.5 unless rope_parameters says
otherwise); the Mamba2 mixer is the standard one (grouped gated norm, `time_step_limit`); the
final norm is `final_layernorm`; the head is tied when `tie_word_embeddings`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from himamba.services.worker.layers.attention import PagedAttention
from himamba.services.worker.layers.gated_mlp import GatedMLP
from himamba.services.worker.layers.mamba2 import Mamba2Mixer
from himamba.services.worker.layers.norm import RMSNorm
from himamba.services.worker.models.hf_config import ConfigFields
from himamba.services.worker.models.hybrid_decoder import (
    HybridDecoderLM,
    LayerNames,
    MixerLayer,
    StackNames,
    pool_layout,
)
from himamba.services.worker.models.mamba2_fields import Mamba2Fields
from himamba.services.worker.models.rope_params import RopeSettings, rope_settings

_KINDS = MappingProxyType(
    {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention", "attention": "attention"}
)


def _layer_kinds(f: ConfigFields, num_layers: int) -> tuple[str, ...]:
    listed = f.get("layers_block_type", "layer_types")
    if listed is not None:
        if not isinstance(listed, list) or any(k not in _KINDS for k in listed) or len(listed) != num_layers:
            raise ValueError(
                f"Bamba config.json: field 'layers_block_type' must list {num_layers} mamba/attention layers, "
                f"got {listed!r}"
            )
        return tuple(_KINDS[k] for k in listed)
    indices = f.get("attn_layer_indices") or []
    if not isinstance(indices, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in indices):
        raise ValueError(f"Bamba config.json: field 'attn_layer_indices' must be a list of integers, got {indices!r}")
    if any(not 0 <= i < num_layers for i in indices):
        raise ValueError(f"Bamba config.json: field 'attn_layer_indices' must be in [0, {num_layers}), got {indices}")
    return tuple("attention" if i in indices else "mamba" for i in range(num_layers))


@dataclass(frozen=True)
class BambaConfig:
    """The Bamba hyper-parameters our implementation uses, parsed from config.json."""

    vocab_size: int
    hidden_size: int
    layer_kinds: tuple[str, ...]  # "mamba" | "attention"
    intermediate_size: int
    hidden_act: str
    mlp_bias: bool
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    rope: RopeSettings
    rms_norm_eps: float
    tie_word_embeddings: bool
    mamba: Mamba2Fields

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> BambaConfig:
        """Parse a raw config.json dict."""
        f = ConfigFields(raw, "Bamba")
        hidden = f.int("hidden_size")
        heads = f.int("num_attention_heads", default=32)
        return cls(
            vocab_size=f.int("vocab_size"),
            hidden_size=hidden,
            layer_kinds=_layer_kinds(f, f.int("num_hidden_layers", default=32)),
            intermediate_size=f.int("intermediate_size", default=14336),
            hidden_act=f.str("hidden_act", default="silu") or "silu",
            mlp_bias=f.bool("mlp_bias", default=False),
            num_attention_heads=heads,
            num_key_value_heads=f.int("num_key_value_heads", default=heads),
            head_dim=f.int("head_dim", default=hidden // heads),
            attention_bias=f.bool("attention_bias", default=False),
            rope=rope_settings(f, default_theta=10000.0, default_partial=0.5),
            rms_norm_eps=f.float("rms_norm_eps", default=1e-5),
            tie_word_embeddings=f.bool("tie_word_embeddings", default=False),
            mamba=Mamba2Fields.parse(f, f.int("mamba_expand", default=2) * hidden),
        )


class BambaLayer(MixerLayer):
    """One decoder layer; exactly one of `mamba` / `self_attn` is set (HF's attribute names)."""

    names = LayerNames(mixer_norm="input_layernorm", recurrent="mamba", ffn_norm="pre_ff_layernorm", ffn="feed_forward")

    def __init__(self, cfg: BambaConfig, kind: str, pool_index: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(pool_index)
        self.kind = kind
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, device, dtype)
        self.pre_ff_layernorm = RMSNorm(h, cfg.rms_norm_eps, device, dtype)
        self.feed_forward = GatedMLP(h, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias, device, dtype)
        self.mamba: Mamba2Mixer | None = None
        self.self_attn: PagedAttention | None = None
        if kind == "mamba":
            self.mamba = cfg.mamba.mixer(h, cfg.rms_norm_eps, cfg.hidden_act, device, dtype)
        else:
            self.self_attn = PagedAttention(
                h,
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim,
                cfg.head_dim**-0.5,
                cfg.attention_bias,
                device,
                dtype,
                rotary=cfg.rope.rotary(cfg.head_dim, device),  # type: ignore[arg-type]  # same call contract
            )


class BambaForCausalLM(HybridDecoderLM):
    """Bamba as a `HybridModel`. Parameters are allocated uninitialised; call `load_weights`."""

    supports_tensor_parallel = True
    config_type = BambaConfig
    stack_names = StackNames(embed="embed_tokens", final_norm="final_layernorm")

    def __init__(self, cfg: BambaConfig, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__(cfg, dtype)
        device = torch.device(device)
        pools = pool_layout(cfg.layer_kinds, "mamba")
        layers = [BambaLayer(cfg, k, i, device, dtype) for k, i in zip(cfg.layer_kinds, pools.indices, strict=True)]
        self.attach_stack(layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype), device, pools.sizes)
