"""Jamba (`JambaForCausalLM`): Mamba1 or attention, then MoE or a SwiGLU MLP, per layer.

Matches transformers 5.23's modeling_jamba: each layer is `h += mixer(input_layernorm(h))` then
`h += feed_forward(pre_ff_layernorm(h))`; layer i has attention when i % attn_layer_period ==
attn_layer_offset (no positional embedding at all) and Mamba1 otherwise (with RMS norms on dt, B
and C); it has MoE when i % expert_layer_period == expert_layer_offset: softmax over all experts,
top-k weights not renormalised. Checkpoints may store experts stacked or per expert.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.layers.attention import PagedAttention
from himamba.services.worker.layers.embedding import LMHead, VocabEmbedding
from himamba.services.worker.layers.gated_mlp import GatedMLP
from himamba.services.worker.layers.mamba1 import Mamba1Mixer
from himamba.services.worker.layers.moe import RoutedExperts
from himamba.services.worker.layers.norm import RMSNorm
from himamba.services.worker.layers.softmax_router import SoftmaxRouter
from himamba.services.worker.models.batch_checks import check_batch
from himamba.services.worker.models.expert_weights import merge_expert_weights, stacked_row
from himamba.services.worker.models.hf_config import ConfigFields
from himamba.services.worker.models.weight_loading import WeightTarget, load_named_weights
from himamba.services.worker.pools import KVPool, KVSpec, StatePool, StateSpec


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

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

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


class JambaLayer(nn.Module):
    """One decoder layer; exactly one of `mamba` / `self_attn` is set (HF's attribute names)."""

    def __init__(self, cfg: JambaConfig, index: int, pool_index: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.pool_index = pool_index
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


class _Backbone(nn.Module):
    def __init__(self, embed_tokens: VocabEmbedding, layers: list[JambaLayer], final_layernorm: RMSNorm) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.final_layernorm = final_layernorm


class JambaForCausalLM(nn.Module):
    """Jamba as a `HybridModel`. Parameters are allocated uninitialised; call `load_weights`."""

    def __init__(self, cfg: JambaConfig, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = cfg
        self.dtype = dtype
        self.vocab_size = cfg.vocab_size
        layers = []
        counts = {"attention": 0, "mamba": 0}
        for i, kind in enumerate(cfg.layer_kinds):
            layers.append(JambaLayer(cfg, i, counts[kind], device, dtype))
            counts[kind] += 1
        self.num_attention_layers = counts["attention"]
        self.num_mamba_layers = counts["mamba"]
        embed = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, device, dtype)
        self.model = _Backbone(embed, layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype))
        self.lm_head = LMHead(
            cfg.vocab_size, cfg.hidden_size, device, dtype, tied_to=embed if cfg.tie_word_embeddings else None
        )

    @classmethod
    def from_hf_config(cls, raw: Mapping[str, Any], device: torch.device | str, dtype: torch.dtype) -> JambaForCausalLM:
        """Build the (uninitialised) model from a raw config.json dict."""
        return cls(JambaConfig.from_hf(raw), device, dtype)

    def kv_spec(self) -> KVSpec:
        """KV pool shape: one entry per attention layer, in model order."""
        return KVSpec(self.num_attention_layers, self.config.num_key_value_heads, self.config.head_dim, self.dtype)

    def state_spec(self) -> StateSpec:
        """State pool shape: "conv" and "ssm" per Mamba1 layer, in model order."""
        return StateSpec(
            tuple(layer.mamba.state_components() for layer in self.model.layers if layer.mamba is not None)
        )

    def forward(self, batch: ForwardBatch, kv: KVPool, state: StatePool) -> torch.Tensor:
        """Logits [B, vocab] (float32) of each sequence's last new token; updates the pools."""
        check_batch(batch, kv, state, self.num_attention_layers, self.num_mamba_layers)
        with torch.inference_mode():
            h = self.model.embed_tokens(batch.input_ids)
            for layer in self.model.layers:
                x = layer.input_layernorm(h)
                if layer.mamba is not None:
                    x = layer.mamba(x, batch, state.tensors[layer.pool_index])
                else:
                    x = layer.self_attn(x, batch, kv.k[layer.pool_index], kv.v[layer.pool_index])
                h = h + x
                h = h + layer.feed_forward(layer.pre_ff_layernorm(h))
            last = h.index_select(0, batch.last_token_index.to(h.device))
            return self.lm_head(self.model.final_layernorm(last))

    def _resolve(self, hf_name: str) -> WeightTarget | None:
        if hf_name == "lm_head.weight" and self.lm_head.is_tied:
            return None
        return stacked_row(hf_name) or WeightTarget(hf_name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (stacked or per-expert MoE layouts); raises ValueError naming missing
        or unexpected weights."""
        load_named_weights(self, merge_expert_weights(weights), self._resolve)
