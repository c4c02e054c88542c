"""LFM2 (`Lfm2ForCausalLM`): gated short convolutions or attention, then a SwiGLU MLP, per layer.

Matches transformers 5.23's modeling_lfm2: each layer is `h += op(operator_norm(h))` then
`h += feed_forward(ffn_norm(h))`; conv layers are `ShortConv` (the conv window is the whole
recurrent state); attention layers RMS-normalise q and k per head (`q_layernorm`, `k_layernorm`),
apply full rope (theta 1e6 by default) and project out with `out_proj`; the MLP is
`w2(silu(w1(x)) * w3(x))` with its width auto-adjusted as transformers does; the final norm is
`embedding_norm`; the head is tied by default.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.layers.embedding import LMHead, VocabEmbedding
from himamba.services.worker.layers.gated_mlp import GatedMLP
from himamba.services.worker.layers.linear import Linear
from himamba.services.worker.layers.norm import RMSNorm
from himamba.services.worker.layers.paged_attend import paged_attend
from himamba.services.worker.layers.partial_rotary import PartialRotaryEmbedding
from himamba.services.worker.layers.short_conv import ShortConv
from himamba.services.worker.models.batch_checks import check_batch
from himamba.services.worker.models.hf_config import ConfigFields
from himamba.services.worker.models.rope_params import RopeSettings, rope_settings
from himamba.services.worker.models.weight_loading import WeightTarget, load_named_weights
from himamba.services.worker.pools import KVPool, KVSpec, StatePool, StateSpec

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
    rope: RopeSettings
    norm_eps: float
    conv_bias: bool
    conv_L_cache: int
    tie_word_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

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
            rope=rope_settings(f, default_theta=1000000.0),
            norm_eps=f.float("norm_eps", default=1e-5),
            conv_bias=f.bool("conv_bias", default=False),
            conv_L_cache=f.int("conv_L_cache", default=3),
            tie_word_embeddings=f.bool("tie_word_embeddings", "tie_embedding", default=True),
        )


class Lfm2Attention(nn.Module):
    """Attention with per-head q/k RMS norms and full rope, over the paged KV pool."""

    def __init__(self, cfg: Lfm2Config, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_key_value_heads ({self.num_kv_heads}) must divide num_attention_heads ({self.num_heads})"
            )
        self.head_dim = hd
        self.q_proj = Linear(h, self.num_heads * hd, False, device, dtype)
        self.k_proj = Linear(h, self.num_kv_heads * hd, False, device, dtype)
        self.v_proj = Linear(h, self.num_kv_heads * hd, False, device, dtype)
        self.out_proj = Linear(self.num_heads * hd, h, False, device, dtype)
        self.q_layernorm = RMSNorm(hd, cfg.norm_eps, device, dtype)
        self.k_layernorm = RMSNorm(hd, cfg.norm_eps, device, dtype)
        self.rotary: PartialRotaryEmbedding = cfg.rope.rotary(hd, device)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_layernorm(self.q_proj(x).view(tokens, self.num_heads, self.head_dim))
        k = self.k_layernorm(self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(q, k, batch.positions)
        out = paged_attend(q, k, v, batch, k_cache, v_cache, self.head_dim**-0.5)
        return self.out_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class Lfm2Layer(nn.Module):
    """One decoder layer; exactly one of `conv` / `self_attn` is set (HF's attribute names)."""

    def __init__(self, cfg: Lfm2Config, kind: str, pool_index: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.pool_index = pool_index
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


class _Backbone(nn.Module):
    def __init__(self, embed_tokens: VocabEmbedding, layers: list[Lfm2Layer], embedding_norm: RMSNorm) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.embedding_norm = embedding_norm


class Lfm2ForCausalLM(nn.Module):
    """LFM2 as a `HybridModel`. Parameters are allocated uninitialised; call `load_weights`."""

    def __init__(self, cfg: Lfm2Config, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = cfg
        self.dtype = dtype
        self.vocab_size = cfg.vocab_size
        layers = []
        counts = {"attention": 0, "conv": 0}
        for kind in cfg.layer_kinds:
            layers.append(Lfm2Layer(cfg, kind, counts[kind], device, dtype))
            counts[kind] += 1
        self.num_attention_layers = counts["attention"]
        self.num_conv_layers = counts["conv"]
        embed = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, device, dtype)
        self.model = _Backbone(embed, layers, RMSNorm(cfg.hidden_size, cfg.norm_eps, device, dtype))
        self.lm_head = LMHead(
            cfg.vocab_size, cfg.hidden_size, device, dtype, tied_to=embed if cfg.tie_word_embeddings else None
        )

    @classmethod
    def from_hf_config(cls, raw: Mapping[str, Any], device: torch.device | str, dtype: torch.dtype) -> Lfm2ForCausalLM:
        """Build the (uninitialised) model from a raw config.json dict."""
        return cls(Lfm2Config.from_hf(raw), device, dtype)

    def kv_spec(self) -> KVSpec:
        """KV pool shape: one entry per attention layer, in model order."""
        return KVSpec(self.num_attention_layers, self.config.num_key_value_heads, self.config.head_dim, self.dtype)

    def state_spec(self) -> StateSpec:
        """State pool shape: "conv" per short-conv layer, in model order."""
        return StateSpec(tuple(layer.conv.state_components() for layer in self.model.layers if layer.conv is not None))

    def forward(self, batch: ForwardBatch, kv: KVPool, state: StatePool) -> torch.Tensor:
        """Logits [B, vocab] (float32) of each sequence's last new token; updates the pools."""
        check_batch(batch, kv, state, self.num_attention_layers, self.num_conv_layers)
        with torch.inference_mode():
            h = self.model.embed_tokens(batch.input_ids)
            for layer in self.model.layers:
                x = layer.operator_norm(h)
                if layer.conv is not None:
                    x = layer.conv(x, batch, state.tensors[layer.pool_index])
                else:
                    x = layer.self_attn(x, batch, kv.k[layer.pool_index], kv.v[layer.pool_index])
                h = h + x
                h = h + layer.feed_forward(layer.ffn_norm(h))
            last = h.index_select(0, batch.last_token_index.to(h.device))
            return self.lm_head(self.model.embedding_norm(last))

    def _resolve(self, hf_name: str) -> WeightTarget | None:
        if hf_name == "lm_head.weight" and self.lm_head.is_tied:
            return None
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None
        for old, new in _MLP_NAMES.items():
            hf_name = hf_name.replace(old, new)
        return WeightTarget(hf_name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; raises ValueError naming missing or unexpected weights."""
        load_named_weights(self, weights, self._resolve)
