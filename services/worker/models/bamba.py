"""Bamba (`BambaForCausalLM`): Mamba2 or attention, then a SwiGLU MLP, per layer.

Matches transformers 5.23's modeling_bamba: each layer is `h += mixer(input_layernorm(h))` then
`h += feed_forward(pre_ff_layernorm(h))`; attention layers are those in `attn_layer_indices`, with
rope over the first half of each head (`partial_rotary_factor` 0.5 unless rope_parameters says
otherwise); the Mamba2 mixer is the standard one (grouped gated norm, `time_step_limit`); the
final norm is `final_layernorm`; the head is tied when `tie_word_embeddings`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.layers.attention import PagedAttention
from himamba.services.worker.layers.embedding import LMHead, VocabEmbedding
from himamba.services.worker.layers.gated_mlp import GatedMLP
from himamba.services.worker.layers.mamba2 import Mamba2Mixer
from himamba.services.worker.layers.norm import RMSNorm
from himamba.services.worker.models.batch_checks import check_batch
from himamba.services.worker.models.hf_config import ConfigFields
from himamba.services.worker.models.rope_params import RopeSettings, rope_settings
from himamba.services.worker.models.weight_loading import WeightTarget, load_named_weights
from himamba.services.worker.pools import KVPool, KVSpec, StatePool, StateSpec

_KINDS = MappingProxyType(
    {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention", "attention": "attention"}
)


def mamba_head_dim(f: ConfigFields, width: int, heads: int) -> int:
    """`mamba_d_head` ("auto" or absent: width / heads), checked against the mamba width."""
    d_head = f.get("mamba_d_head")
    if d_head is None or d_head == "auto":
        d_head = width // heads
    elif isinstance(d_head, bool) or not isinstance(d_head, int):
        raise ValueError(f"{f.family} config.json: field 'mamba_d_head' must be an integer or 'auto', got {d_head!r}")
    if d_head * heads != width:
        raise ValueError(
            f"{f.family} config.json: field 'mamba_d_head' ({d_head}) times mamba_n_heads ({heads}) must equal "
            f"the mamba width ({width})"
        )
    return d_head


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
    def from_hf(cls, raw: Mapping[str, Any]) -> BambaConfig:
        """Parse a raw config.json dict."""
        f = ConfigFields(raw, "Bamba")
        hidden = f.int("hidden_size")
        heads = f.int("num_attention_heads", default=32)
        mamba_heads = f.int("mamba_n_heads", default=128)
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
            mamba_n_heads=mamba_heads,
            mamba_d_head=mamba_head_dim(f, f.int("mamba_expand", default=2) * hidden, mamba_heads),
            mamba_d_state=f.int("mamba_d_state", default=256),
            mamba_n_groups=f.int("mamba_n_groups", default=1),
            mamba_d_conv=f.int("mamba_d_conv", default=4),
            mamba_chunk_size=f.int("mamba_chunk_size", default=256),
            mamba_conv_bias=f.bool("mamba_conv_bias", default=True),
            mamba_proj_bias=f.bool("mamba_proj_bias", default=False),
            time_step_limit=f.float_pair("time_step_limit", default=(0.0, float("inf"))),
        )


class BambaLayer(nn.Module):
    """One decoder layer; exactly one of `mamba` / `self_attn` is set (HF's attribute names)."""

    def __init__(self, cfg: BambaConfig, kind: str, pool_index: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.kind = kind
        self.pool_index = pool_index
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, device, dtype)
        self.pre_ff_layernorm = RMSNorm(h, cfg.rms_norm_eps, device, dtype)
        self.feed_forward = GatedMLP(h, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias, device, dtype)
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


class _Backbone(nn.Module):
    def __init__(self, embed_tokens: VocabEmbedding, layers: list[BambaLayer], final_layernorm: RMSNorm) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.final_layernorm = final_layernorm


class BambaForCausalLM(nn.Module):
    """Bamba as a `HybridModel`. Parameters are allocated uninitialised; call `load_weights`."""

    def __init__(self, cfg: BambaConfig, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = cfg
        self.dtype = dtype
        self.vocab_size = cfg.vocab_size
        layers = []
        counts = {"attention": 0, "mamba": 0}
        for kind in cfg.layer_kinds:
            layers.append(BambaLayer(cfg, kind, counts[kind], device, dtype))
            counts[kind] += 1
        self.num_attention_layers = counts["attention"]
        self.num_mamba_layers = counts["mamba"]
        embed = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, device, dtype)
        self.model = _Backbone(embed, layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype))
        self.lm_head = LMHead(
            cfg.vocab_size, cfg.hidden_size, device, dtype, tied_to=embed if cfg.tie_word_embeddings else None
        )

    @classmethod
    def from_hf_config(cls, raw: Mapping[str, Any], device: torch.device | str, dtype: torch.dtype) -> BambaForCausalLM:
        """Build the (uninitialised) model from a raw config.json dict."""
        return cls(BambaConfig.from_hf(raw), device, dtype)

    def kv_spec(self) -> KVSpec:
        """KV pool shape: one entry per attention layer, in model order."""
        return KVSpec(self.num_attention_layers, self.config.num_key_value_heads, self.config.head_dim, self.dtype)

    def state_spec(self) -> StateSpec:
        """State pool shape: "conv" and "ssm" per Mamba layer, in model order."""
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
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None
        return WeightTarget(hf_name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; raises ValueError naming missing or unexpected weights."""
        load_named_weights(self, weights, self._resolve)
