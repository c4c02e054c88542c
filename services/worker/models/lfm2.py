"""LFM2 (`Lfm2ForCausalLM`): gated short convolutions or attention, then a SwiGLU MLP, per layer.

Matches transformers 5.23's modeling_lfm2: each layer is `h += op(operator_norm(h))` then
`h += feed_forward(ffn_norm(h))`; conv layers are `ShortConv` (the conv window is the whole
recurrent state); attention layers RMS-normalise q and k per head (`q_layernorm`, `k_layernorm`),
apply full rope (theta 1e6 by default) and project out with `out_proj`; the MLP is
`w2(silu(w1(x)) * w3(x))` with its width auto-adjusted as transformers does; the final norm is
`embedding_norm`; the head is tied by default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.layers.gated_mlp import GatedMLP
from himamba.services.worker.layers.norm import RMSNorm
from himamba.services.worker.layers.partial_rotary import PartialRotaryEmbedding
from himamba.services.worker.layers.projected_attention import ProjectedAttention
from himamba.services.worker.layers.short_conv import ShortConv
from himamba.services.worker.models.hf_config import ConfigFields
from himamba.services.worker.models.hybrid_decoder import (
    HybridDecoderLM,
    LayerNames,
    MixerLayer,
    StackNames,
    pool_layout,
)
from himamba.services.worker.models.rope_params import RopeSettings, rope_settings
from himamba.services.worker.models.weight_loading import WeightTarget

_KINDS = MappingProxyType({"conv": "conv", "full_attention": "attention"})
# LFM2's MLP names -> GatedMLP's.
_MLP_NAMES = MappingProxyType(
    {
        "feed_forward.w1.": "feed_forward.gate_proj.",
        "feed_forward.w3.": "feed_forward.up_proj.",
        "feed_forward.w2.": "feed_forward.down_proj.",
    }
)


def _layer_kinds(f: ConfigFields, num_layers: int) -> tuple[str, ...]:
    listed = f.get("layer_types")
    if listed is None:
        indices = f.get("full_attn_idxs")
        if indices is None:
            indices = list(range(num_layers))
        if not isinstance(indices, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in indices):
            raise ValueError(f"Lfm2 config.json: field 'full_attn_idxs' must be a list of integers, got {indices!r}")
        return tuple("attention" if i in indices else "conv" for i in range(num_layers))
    if not isinstance(listed, list) or any(k not in _KINDS for k in listed) or len(listed) != num_layers:
        raise ValueError(
            f"Lfm2 config.json: field 'layer_types' must list {num_layers} conv/full_attention layers, got {listed!r}"
        )
    return tuple(_KINDS[k] for k in listed)


def _mlp_width(f: ConfigFields) -> int:
    """transformers' Lfm2MLP width: 2/3 of intermediate_size, times the multiplier, rounded up to
    `block_multiple_of`, when `block_auto_adjust_ff_dim`."""
    width = f.int("intermediate_size", "block_ff_dim", default=12288)
    if not f.bool("block_auto_adjust_ff_dim", default=True):
        return width
    width = int(2 * width / 3)
    multiplier = f.get("block_ffn_dim_multiplier")
    if multiplier is not None:
        multiple = f.int("block_multiple_of", default=256)
        width = int(f.float("block_ffn_dim_multiplier") * width)
        width = multiple * ((width + multiple - 1) // multiple)
    return width


@dataclass(frozen=True)
class Lfm2Config:
    """The LFM2 hyper-parameters our implementation uses, parsed from config.json."""

    vocab_size: int
    hidden_size: int
    layer_kinds: tuple[str, ...]  # "conv" | "attention"
    mlp_width: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # `head_dim` when given, else hidden_size / num_attention_heads (as transformers)
    rope: RopeSettings
    norm_eps: float
    conv_bias: bool
    conv_L_cache: int
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> Lfm2Config:
        """Parse a raw config.json dict (`layer_types`, or the older `full_attn_idxs`)."""
        f = ConfigFields(raw, "Lfm2")
        heads = f.int("num_attention_heads", default=32)
        return cls(
            vocab_size=f.int("vocab_size"),
            hidden_size=f.int("hidden_size"),
            layer_kinds=_layer_kinds(f, f.int("num_hidden_layers", default=32)),
            mlp_width=_mlp_width(f),
            num_attention_heads=heads,
            num_key_value_heads=f.int("num_key_value_heads", default=8),
            head_dim=f.int("head_dim", default=f.int("hidden_size") // heads),
            rope=rope_settings(f, default_theta=1000000.0, reads_partial=False),
            norm_eps=f.float("norm_eps", default=1e-5),
            conv_bias=f.bool("conv_bias", default=False),
            conv_L_cache=f.int("conv_L_cache", default=3),
            tie_word_embeddings=f.bool("tie_word_embeddings", "tie_embedding", default=True),
        )


class Lfm2Attention(ProjectedAttention):
    """Attention with per-head q/k RMS norms and full rope, projected out by `out_proj`."""

    def __init__(self, cfg: Lfm2Config, device: torch.device, dtype: torch.dtype) -> None:
        h, hd = cfg.hidden_size, cfg.head_dim
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        super().__init__(h, h, heads, kv_heads, hd, False, device, dtype, out_name="out_proj")
        self.q_layernorm = RMSNorm(hd, cfg.norm_eps, device, dtype)
        self.k_layernorm = RMSNorm(hd, cfg.norm_eps, device, dtype)
        self.rotary: PartialRotaryEmbedding = cfg.rope.rotary(hd, device)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        q, k, v = self.split_heads(*self.project_qkv(x))
        q, k = self.rotary(self.q_layernorm(q), self.k_layernorm(k), batch.positions)
        return self.out_proj(self.attend(q, k, v, batch, k_cache, v_cache, self.head_dim**-0.5))


class Lfm2Layer(MixerLayer):
    """One decoder layer; exactly one of `conv` / `self_attn` is set (HF's attribute names)."""

    names = LayerNames(mixer_norm="operator_norm", recurrent="conv", ffn_norm="ffn_norm", ffn="feed_forward")

    def __init__(self, cfg: Lfm2Config, kind: str, pool_index: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(pool_index)
        h = cfg.hidden_size
        self.operator_norm = RMSNorm(h, cfg.norm_eps, device, dtype)
        self.ffn_norm = RMSNorm(h, cfg.norm_eps, device, dtype)
        self.feed_forward = GatedMLP(h, cfg.mlp_width, "silu", False, device, dtype)
        self.conv: ShortConv | None = None
        self.self_attn: Lfm2Attention | None = None
        if kind == "conv":
            self.conv = ShortConv(h, cfg.conv_L_cache, cfg.conv_bias, device, dtype)
        else:
            self.self_attn = Lfm2Attention(cfg, device, dtype)


class Lfm2ForCausalLM(HybridDecoderLM):
    """LFM2 as a `HybridModel`. Parameters are allocated uninitialised; call `load_weights`."""

    config_type = Lfm2Config
    stack_names = StackNames(embed="embed_tokens", final_norm="embedding_norm")

    def __init__(self, cfg: Lfm2Config, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__(cfg, dtype)
        device = torch.device(device)
        pools = pool_layout(cfg.layer_kinds, "conv")
        layers = [
            Lfm2Layer(cfg, kind, pool, device, dtype) for kind, pool in zip(cfg.layer_kinds, pools.indices, strict=True)
        ]
        self.attach_stack(layers, RMSNorm(cfg.hidden_size, cfg.norm_eps, device, dtype), device, pools.sizes)

    def rename_weight(self, hf_name: str) -> WeightTarget:
        for old, new in _MLP_NAMES.items():
            hf_name = hf_name.replace(old, new)
        return WeightTarget(hf_name)
