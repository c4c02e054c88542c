"""Granite-4.0-H (`GraniteMoeHybridForCausalLM`): Mamba2 or attention, then a (MoE +) shared MLP, per layer.

Matches transformers 5.23's modeling_granitemoehybrid: embeddings times `embedding_multiplier`;
each layer is `h += mixer(input_layernorm(h)) * residual_multiplier` then
`h += (moe(x) + shared_mlp(x)) * residual_multiplier` with x = post_attention_layernorm(h)
(no MoE when `num_local_experts` is 0); attention scale is `attention_multiplier`, rotary only
when `position_embedding_type == "rope"`; logits are divided by `logits_scaling`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.layers.attention import PagedAttention
from himamba.services.worker.layers.mamba2 import Mamba2Mixer
from himamba.services.worker.layers.mlp import FusedGatedMLP
from himamba.services.worker.layers.moe import RoutedExperts, SoftmaxTopKRouter
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
from himamba.services.worker.models.weight_loading import WeightTarget
from himamba.services.worker.pools import KVPool, StatePool

_LAYER_KINDS = MappingProxyType(
    {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention", "full_attention": "attention"}
)
# Published Granite MoE checkpoints name the stacked experts and the router differently.
_LEGACY_MOE = (
    (re.compile(r"\.block_sparse_moe\.input_linear\.weight$"), ".block_sparse_moe.experts.gate_up_proj"),
    (re.compile(r"\.block_sparse_moe\.output_linear\.weight$"), ".block_sparse_moe.experts.down_proj"),
    (re.compile(r"\.block_sparse_moe\.router\.layer\.weight$"), ".block_sparse_moe.router.weight"),
)


@dataclass(frozen=True)
class GraniteHybridConfig:
    """The Granite-4.0-H hyper-parameters our implementation uses, parsed from config.json."""

    vocab_size: int
    hidden_size: int
    layer_kinds: tuple[str, ...]  # "mamba" | "attention"
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    attention_multiplier: float
    rope: RopeSettings | None  # None: no positional embedding
    shared_intermediate_size: int
    intermediate_size: int
    hidden_act: str
    num_local_experts: int
    num_experts_per_tok: int
    rms_norm_eps: float
    embedding_multiplier: float
    residual_multiplier: float
    logits_scaling: float
    tie_word_embeddings: bool
    mamba: Mamba2Fields

    @property
    def rope_theta(self) -> float | None:
        """The rope base frequency; None when the model has no positional embedding."""
        return None if self.rope is None else self.rope.theta

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> GraniteHybridConfig:
        """Parse a raw config.json dict (published "mamba"/"attention" or transformers-5 layer names)."""
        f = ConfigFields(raw, "GraniteMoeHybrid")
        hidden = f.int("hidden_size")
        layers = f.int("num_hidden_layers", default=32)
        names = f.get("layer_types", "layers_block_type")
        if names is None:
            names = ["mamba"] * layers
        if not isinstance(names, list) or any(n not in _LAYER_KINDS for n in names):
            raise ValueError(
                f"GraniteMoeHybrid config.json: field 'layer_types' must list mamba/attention layers, got {names!r}"
            )
        if len(names) != layers:
            raise ValueError(
                f"GraniteMoeHybrid config.json: field 'layer_types' has {len(names)} entries, "
                f"num_hidden_layers is {layers}"
            )
        heads = f.int("num_attention_heads", default=32)
        return cls(
            vocab_size=f.int("vocab_size"),
            hidden_size=hidden,
            layer_kinds=tuple(_LAYER_KINDS[n] for n in names),
            num_attention_heads=heads,
            num_key_value_heads=f.int("num_key_value_heads", default=heads),
            head_dim=f.int("head_dim", default=hidden // heads),
            attention_bias=f.bool("attention_bias", default=False),
            attention_multiplier=f.float("attention_multiplier", default=1.0),
            rope=_rope(f),
            shared_intermediate_size=f.int("shared_intermediate_size", default=1024),
            intermediate_size=f.int("intermediate_size", default=11008),
            hidden_act=f.str("hidden_act", default="silu") or "silu",
            num_local_experts=f.int("num_local_experts", default=8),
            num_experts_per_tok=f.int("num_experts_per_tok", default=2),
            rms_norm_eps=f.float("rms_norm_eps", default=1e-6),
            embedding_multiplier=f.float("embedding_multiplier", default=1.0),
            residual_multiplier=f.float("residual_multiplier", default=1.0),
            logits_scaling=f.float("logits_scaling", default=1.0),
            tie_word_embeddings=f.bool("tie_word_embeddings", default=False),
            mamba=Mamba2Fields.parse(f, f.int("mamba_expand", default=2) * hidden),
        )


def _rope(f: ConfigFields) -> RopeSettings | None:
    if f.str("position_embedding_type") != "rope":
        return None
    # transformers' Granite rope rotates the whole head whatever partial_rotary_factor says.
    return rope_settings(f, default_theta=10000.0, reads_partial=False)


class GraniteHybridMoE(nn.Module):
    """Softmax-top-k routed SwiGLU experts (HF `block_sparse_moe`)."""

    def __init__(self, cfg: GraniteHybridConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.router = SoftmaxTopKRouter(cfg.hidden_size, cfg.num_local_experts, cfg.num_experts_per_tok, device, dtype)
        self.experts = RoutedExperts(
            cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, True, device, dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


class GraniteHybridLayer(MixerLayer):
    """One decoder layer; exactly one of `mamba` / `self_attn` is set (HF's attribute names). Both
    residual branches are scaled by `residual_multiplier`; the feed-forward is the shared MLP plus
    the MoE when there is one."""

    names = LayerNames(
        mixer_norm="input_layernorm", recurrent="mamba", ffn_norm="post_attention_layernorm", ffn="shared_mlp"
    )

    def __init__(
        self, cfg: GraniteHybridConfig, kind: str, pool_index: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__(pool_index)
        self.kind = kind
        self.residual_multiplier = cfg.residual_multiplier
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, device, dtype)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, device, dtype)
        self.mamba: Mamba2Mixer | None = None
        self.self_attn: PagedAttention | None = None
        if kind == "mamba":
            self.mamba = cfg.mamba.mixer(h, cfg.rms_norm_eps, cfg.hidden_act, device, dtype)
        else:
            rotary = cfg.rope.rotary(cfg.head_dim, device) if cfg.rope is not None else None
            self.self_attn = PagedAttention(
                h,
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim,
                cfg.attention_multiplier,
                cfg.attention_bias,
                device,
                dtype,
                rotary=rotary,
            )
        self.block_sparse_moe = GraniteHybridMoE(cfg, device, dtype) if cfg.num_local_experts > 0 else None
        self.shared_mlp = FusedGatedMLP(h, cfg.shared_intermediate_size, cfg.hidden_act, False, device, dtype)

    def step(self, h: torch.Tensor, batch: ForwardBatch, kv: KVPool, state: StatePool) -> torch.Tensor:
        scale = self.residual_multiplier
        h = h + self.mix(self.input_layernorm(h), batch, kv, state) * scale
        x = self.post_attention_layernorm(h)
        mlp = self.shared_mlp(x)
        if self.block_sparse_moe is not None:
            mlp = self.block_sparse_moe(x) + mlp
        return h + mlp * scale


class GraniteHybridForCausalLM(HybridDecoderLM):
    """Granite-4.0-H as a `HybridModel`. Parameters are allocated uninitialised; call `load_weights`."""

    supports_tensor_parallel = True
    config_type = GraniteHybridConfig
    stack_names = StackNames(embed="embed_tokens", final_norm="norm")

    def __init__(self, cfg: GraniteHybridConfig, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__(cfg, dtype)
        device = torch.device(device)
        pools = pool_layout(cfg.layer_kinds, "mamba")
        layers = [
            GraniteHybridLayer(cfg, kind, pool, device, dtype)
            for kind, pool in zip(cfg.layer_kinds, pools.indices, strict=True)
        ]
        self.attach_stack(
            layers,
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype),
            device,
            pools.sizes,
            embedding_multiplier=cfg.embedding_multiplier,
            logits_divisor=cfg.logits_scaling,
        )

    def rename_weight(self, hf_name: str) -> WeightTarget:
        for pattern, replacement in _LEGACY_MOE:
            hf_name = pattern.sub(replacement, hf_name)
        return WeightTarget(hf_name)
