"""Jamba (`JambaForCausalLM`): Mamba1 or attention, then MoE or a SwiGLU MLP, per layer.

Matches transformers 5.23's modeling_jamba: each layer is `h += mixer(input_layernorm(h))` then
`h += feed_forward(pre_ff_layernorm(h))`; layer i has attention when i % attn_layer_period ==
attn_layer_offset (no positional embedding at all) and Mamba1 otherwise (with RMS norms on dt, B
and C); it has MoE when i % expert_layer_period == expert_layer_offset: softmax over all experts,
top-k weights not renormalised. Checkpoints may store experts stacked or per expert.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from himamba.services.worker.layers.attention import PagedAttention
from himamba.services.worker.layers.gated_mlp import GatedMLP
from himamba.services.worker.layers.mamba1 import Mamba1Mixer
from himamba.services.worker.layers.moe import RoutedExperts
from himamba.services.worker.layers.norm import RMSNorm
from himamba.services.worker.layers.softmax_router import SoftmaxRouter
from himamba.services.worker.models.hf_config import ConfigFields
from himamba.services.worker.models.hybrid_decoder import (
    HybridDecoderLM,
    LayerNames,
    MixerLayer,
    StackNames,
    pool_layout,
)


def _period(f: ConfigFields, period_name: str, offset_name: str, default: tuple[int, int]) -> tuple[int, int]:
    period = f.int(period_name, default=default[0])
    offset = f.int(offset_name, default=default[1])
    if period < 1 or not 0 <= offset < period:
        raise ValueError(f"Jamba config.json: field {offset_name!r} ({offset}) must be in [0, {period_name}={period})")
    return period, offset


@dataclass(frozen=True)
class JambaConfig:
    """The Jamba hyper-parameters our implementation uses, parsed from config.json."""

    vocab_size: int
    hidden_size: int
    layer_kinds: tuple[str, ...]  # "mamba" | "attention"
    moe_layers: tuple[bool, ...]
    intermediate_size: int
    hidden_act: str
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # `head_dim` when given, else hidden_size / num_attention_heads (as transformers)
    rms_norm_eps: float
    tie_word_embeddings: bool
    num_experts: int
    num_experts_per_tok: int
    mamba_d_state: int
    mamba_d_conv: int
    mamba_expand: int
    mamba_dt_rank: int
    mamba_conv_bias: bool
    mamba_proj_bias: bool

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> JambaConfig:
        """Parse a raw config.json dict."""
        f = ConfigFields(raw, "Jamba")
        hidden = f.int("hidden_size")
        num_layers = f.int("num_hidden_layers", default=32)
        heads = f.int("num_attention_heads", default=32)
        attn_period, attn_offset = _period(f, "attn_layer_period", "attn_layer_offset", (8, 4))
        expert_period, expert_offset = _period(f, "expert_layer_period", "expert_layer_offset", (2, 1))
        experts = f.int("num_experts", "num_local_experts", default=16)
        rank = f.get("mamba_dt_rank")
        if rank is None or rank == "auto":
            rank = math.ceil(hidden / 16)
        elif isinstance(rank, bool) or not isinstance(rank, int):
            raise ValueError(f"Jamba config.json: field 'mamba_dt_rank' must be an integer or 'auto', got {rank!r}")
        return cls(
            vocab_size=f.int("vocab_size"),
            hidden_size=hidden,
            layer_kinds=tuple("attention" if i % attn_period == attn_offset else "mamba" for i in range(num_layers)),
            moe_layers=tuple(experts > 1 and i % expert_period == expert_offset for i in range(num_layers)),
            intermediate_size=f.int("intermediate_size", default=14336),
            hidden_act=f.str("hidden_act", default="silu") or "silu",
            num_attention_heads=heads,
            num_key_value_heads=f.int("num_key_value_heads", default=heads),
            head_dim=f.int("head_dim", default=hidden // heads),
            rms_norm_eps=f.float("rms_norm_eps", default=1e-6),
            tie_word_embeddings=f.bool("tie_word_embeddings", default=False),
            num_experts=experts,
            num_experts_per_tok=f.int("num_experts_per_tok", default=2),
            mamba_d_state=f.int("mamba_d_state", default=16),
            mamba_d_conv=f.int("mamba_d_conv", default=4),
            mamba_expand=f.int("mamba_expand", default=2),
            mamba_dt_rank=rank,
            mamba_conv_bias=f.bool("mamba_conv_bias", default=True),
            mamba_proj_bias=f.bool("mamba_proj_bias", default=False),
        )


class JambaMoE(nn.Module):
    """Softmax top-k routed SwiGLU experts, weights not renormalised (HF `JambaSparseMoeBlock`)."""

    def __init__(self, cfg: JambaConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.router = SoftmaxRouter(h, cfg.num_experts, cfg.num_experts_per_tok, False, device, dtype)
        self.experts = RoutedExperts(cfg.num_experts, h, cfg.intermediate_size, cfg.hidden_act, True, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


class JambaLayer(MixerLayer):
    """One decoder layer; exactly one of `mamba` / `self_attn` is set (HF's attribute names)."""

    names = LayerNames(mixer_norm="input_layernorm", recurrent="mamba", ffn_norm="pre_ff_layernorm", ffn="feed_forward")

    def __init__(self, cfg: JambaConfig, index: int, pool_index: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(pool_index)
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, device, dtype)
        self.pre_ff_layernorm = RMSNorm(h, cfg.rms_norm_eps, device, dtype)
        self.mamba: Mamba1Mixer | None = None
        self.self_attn: PagedAttention | None = None
        if cfg.layer_kinds[index] == "mamba":
            self.mamba = Mamba1Mixer(
                hidden_size=h,
                intermediate_size=cfg.mamba_expand * h,
                state_size=cfg.mamba_d_state,
                dt_rank=cfg.mamba_dt_rank,
                conv_kernel=cfg.mamba_d_conv,
                device=device,
                dtype=dtype,
                conv_bias=cfg.mamba_conv_bias,
                proj_bias=cfg.mamba_proj_bias,
                inner_norm_eps=cfg.rms_norm_eps,
                activation=cfg.hidden_act,
            )
        else:
            self.self_attn = PagedAttention(
                h,
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim,
                cfg.head_dim**-0.5,
                False,
                device,
                dtype,
            )
        self.feed_forward: nn.Module = (
            JambaMoE(cfg, device, dtype)
            if cfg.moe_layers[index]
            else GatedMLP(h, cfg.intermediate_size, cfg.hidden_act, False, device, dtype)
        )


class JambaForCausalLM(HybridDecoderLM):
    """Jamba as a `HybridModel`. Parameters are allocated uninitialised; call `load_weights`."""

    config_type = JambaConfig
    stack_names = StackNames(embed="embed_tokens", final_norm="final_layernorm")
    skipped_suffixes = ()  # no rope, so no rotary buffers
    merges_expert_weights = True

    def __init__(self, cfg: JambaConfig, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__(cfg, dtype)
        device = torch.device(device)
        pools = pool_layout(cfg.layer_kinds, "mamba")
        layers = [JambaLayer(cfg, i, pool, device, dtype) for i, pool in enumerate(pools.indices)]
        self.attach_stack(layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype), device, pools.sizes)
