"""Granite-4.0-H (`GraniteMoeHybridForCausalLM`): Mamba2 or attention, then a (MoE +) shared MLP, per layer.

Matches transformers 5.23's modeling_granitemoehybrid: embeddings times `embedding_multiplier`;
each layer is `h += mixer(input_layernorm(h)) * residual_multiplier` then
`h += (moe(x) + shared_mlp(x)) * residual_multiplier` with x = post_attention_layernorm(h)
(no MoE when `num_local_experts` is 0); attention scale is `attention_multiplier`, rotary only
when `position_embedding_type == "rope"`; logits are divided by `logits_scaling`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.layers.attention import PagedAttention
from himamba.services.worker.layers.embedding import LMHead, VocabEmbedding
from himamba.services.worker.layers.mamba2 import Mamba2Mixer
from himamba.services.worker.layers.mlp import FusedGatedMLP
from himamba.services.worker.layers.moe import RoutedExperts, SoftmaxTopKRouter
from himamba.services.worker.layers.norm import RMSNorm
from himamba.services.worker.layers.rotary import RotaryEmbedding
from himamba.services.worker.models.batch_checks import check_batch
from himamba.services.worker.models.hf_config import ConfigFields
from himamba.services.worker.models.weight_loading import WeightTarget, load_named_weights
from himamba.services.worker.pools import KVPool, KVSpec, StatePool, StateSpec

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
    rope_theta: float | None  # None: no positional embedding
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
    mamba_n_heads: int
    mamba_d_head: int
    mamba_d_state: int
    mamba_n_groups: int
    mamba_d_conv: int
    mamba_chunk_size: int
    mamba_conv_bias: bool
    mamba_proj_bias: bool
    time_step_limit: tuple[float, float]

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
        expand = f.int("mamba_expand", default=2)
        mamba_heads = f.int("mamba_n_heads", default=128)
        d_head = f.get("mamba_d_head")
        if d_head is None or d_head == "auto":
            d_head = expand * hidden // mamba_heads
        elif isinstance(d_head, bool) or not isinstance(d_head, int):
            raise ValueError(
                f"GraniteMoeHybrid config.json: field 'mamba_d_head' must be an integer or 'auto', got {d_head!r}"
            )
        if d_head * mamba_heads != expand * hidden:
            raise ValueError(
                f"GraniteMoeHybrid config.json: field 'mamba_d_head' ({d_head}) times mamba_n_heads ({mamba_heads}) "
                f"must equal mamba_expand * hidden_size ({expand * hidden})"
            )
        return cls(
            vocab_size=f.int("vocab_size"),
            hidden_size=hidden,
            layer_kinds=tuple(_LAYER_KINDS[n] for n in names),
            num_attention_heads=heads,
            num_key_value_heads=f.int("num_key_value_heads", default=heads),
            head_dim=f.int("head_dim", default=hidden // heads),
            attention_bias=f.bool("attention_bias", default=False),
            attention_multiplier=f.float("attention_multiplier", default=1.0),
            rope_theta=_rope_theta(f),
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
            mamba_n_heads=mamba_heads,
            mamba_d_head=d_head,
            mamba_d_state=f.int("mamba_d_state", default=256),
            mamba_n_groups=f.int("mamba_n_groups", default=1),
            mamba_d_conv=f.int("mamba_d_conv", default=4),
            mamba_chunk_size=f.int("mamba_chunk_size", default=256),
            mamba_conv_bias=f.bool("mamba_conv_bias", default=True),
            mamba_proj_bias=f.bool("mamba_proj_bias", default=False),
            time_step_limit=f.float_pair("time_step_limit", default=(0.0, float("inf"))),
        )


def _rope_theta(f: ConfigFields) -> float | None:
    if f.str("position_embedding_type") != "rope":
        return None
    params = f.get("rope_parameters", "rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"GraniteMoeHybrid config.json: field 'rope_parameters' must be an object, got {params!r}")
    params = params or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"GraniteMoeHybrid config.json: rope_type {rope_type!r} is not supported (only 'default')")
    theta = params.get("rope_theta", f.get("rope_theta"))
    if theta is None:
        return 10000.0
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise ValueError(f"GraniteMoeHybrid config.json: field 'rope_theta' must be a number, got {theta!r}")
    return float(theta)


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


class GraniteHybridLayer(nn.Module):
    """One decoder layer; exactly one of `mamba` / `self_attn` is set (HF's attribute names)."""

    def __init__(
        self, cfg: GraniteHybridConfig, kind: str, pool_index: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.kind = kind
        self.pool_index = pool_index
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, device, dtype)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, device, dtype)
        self.mamba: Mamba2Mixer | None = None
        self.self_attn: PagedAttention | None = None
        if kind == "mamba":
            self.mamba = Mamba2Mixer(
                hidden_size=h,
                num_heads=cfg.mamba_n_heads,
                head_dim=cfg.mamba_d_head,
                state_size=cfg.mamba_d_state,
                n_groups=cfg.mamba_n_groups,
                conv_kernel=cfg.mamba_d_conv,
                chunk_size=cfg.mamba_chunk_size,
                norm_eps=cfg.rms_norm_eps,
                device=device,
                dtype=dtype,
                dt_limit=cfg.time_step_limit,
                conv_bias=cfg.mamba_conv_bias,
                proj_bias=cfg.mamba_proj_bias,
                activation=cfg.hidden_act,
            )
        else:
            rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, device) if cfg.rope_theta is not None else None
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


class _Backbone(nn.Module):
    def __init__(self, embed_tokens: VocabEmbedding, layers: list[GraniteHybridLayer], norm: RMSNorm) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class GraniteHybridForCausalLM(nn.Module):
    """Granite-4.0-H as a `HybridModel`. Parameters are allocated uninitialised; call `load_weights`."""

    def __init__(self, cfg: GraniteHybridConfig, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = cfg
        self.dtype = dtype
        self.vocab_size = cfg.vocab_size
        layers = []
        counts = {"attention": 0, "mamba": 0}
        for kind in cfg.layer_kinds:
            layers.append(GraniteHybridLayer(cfg, kind, counts[kind], device, dtype))
            counts[kind] += 1
        self.num_attention_layers = counts["attention"]
        self.num_mamba_layers = counts["mamba"]
        embed = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, device, dtype, multiplier=cfg.embedding_multiplier)
        self.model = _Backbone(embed, layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype))
        self.lm_head = LMHead(
            cfg.vocab_size,
            cfg.hidden_size,
            device,
            dtype,
            tied_to=embed if cfg.tie_word_embeddings else None,
            logits_divisor=cfg.logits_scaling,
        )

    @classmethod
    def from_hf_config(
        cls, raw: Mapping[str, Any], device: torch.device | str, dtype: torch.dtype
    ) -> GraniteHybridForCausalLM:
        """Build the (uninitialised) model from a raw config.json dict."""
        return cls(GraniteHybridConfig.from_hf(raw), device, dtype)

    def kv_spec(self) -> KVSpec:
        """KV pool shape: one entry per attention layer, in model order."""
        return KVSpec(self.num_attention_layers, self.config.num_key_value_heads, self.config.head_dim, self.dtype)

    def state_spec(self) -> StateSpec:
        """State pool shape: "conv" and "ssm" per Mamba layer, in model order."""
        return StateSpec(
            tuple(layer.mamba.state_components() for layer in self.model.layers if layer.mamba is not None)
        )

    def forward(self, batch: ForwardBatch, kv: KVPool, state: StatePool) -> torch.Tensor:
        """Logits [B, vocab] (float32) of each sequence's last new token; updates the pools.

        Runs under `torch.inference_mode()` itself, so callers need not.
        """
        check_batch(batch, kv, state, self.num_attention_layers, self.num_mamba_layers)
        scale = self.config.residual_multiplier
        with torch.inference_mode():
            h = self.model.embed_tokens(batch.input_ids)
            for layer in self.model.layers:
                x = layer.input_layernorm(h)
                if layer.mamba is not None:
                    x = layer.mamba(x, batch, state.tensors[layer.pool_index])
                else:
                    x = layer.self_attn(x, batch, kv.k[layer.pool_index], kv.v[layer.pool_index])
                h = h + x * scale
                x = layer.post_attention_layernorm(h)
                mlp = layer.shared_mlp(x)
                if layer.block_sparse_moe is not None:
                    mlp = layer.block_sparse_moe(x) + mlp
                h = h + mlp * scale
            last = h.index_select(0, batch.last_token_index.to(h.device))
            return self.lm_head(self.model.norm(last))

    def _resolve(self, hf_name: str) -> WeightTarget | None:
        if hf_name == "lm_head.weight" and self.lm_head.is_tied:
            return None
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None
        for pattern, replacement in _LEGACY_MOE:
            hf_name = pattern.sub(replacement, hf_name)
        return WeightTarget(hf_name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; raises ValueError naming missing or unexpected weights."""
        load_named_weights(self, weights, self._resolve)
