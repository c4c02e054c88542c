"""Falcon-H1 (`FalconH1ForCausalLM`): attention and Mamba2 side by side in every layer, then an MLP.

Matches transformers 5.23's modeling_falcon_h1: embeddings times `embedding_multiplier`; each layer
is `x = input_layernorm(h)`, `h += mamba(x) * ssm_out_multiplier + attn(x * attention_in_multiplier)
* attention_out_multiplier`, then `h += feed_forward(pre_ff_layernorm(h))` with the MLP's
`mlp_multipliers`; K is scaled by `key_multiplier` before rope (and cached scaled); logits are
multiplied by `lm_head_multiplier`. Every layer owns one KV layer and one state layer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.layers.embedding import LMHead, VocabEmbedding
from himamba.services.worker.layers.falcon_h1_mixer import FalconH1Mixer
from himamba.services.worker.layers.gated_mlp import GatedMLP
from himamba.services.worker.layers.linear import Linear
from himamba.services.worker.layers.norm import RMSNorm
from himamba.services.worker.layers.paged_attend import paged_attend
from himamba.services.worker.layers.partial_rotary import PartialRotaryEmbedding
from himamba.services.worker.models.bamba import mamba_head_dim
from himamba.services.worker.models.batch_checks import check_batch
from himamba.services.worker.models.hf_config import ConfigFields
from himamba.services.worker.models.rope_params import RopeSettings, rope_settings
from himamba.services.worker.models.weight_loading import WeightTarget, load_named_weights
from himamba.services.worker.pools import KVPool, KVSpec, StatePool, StateSpec


def _multipliers(f: ConfigFields, name: str, count: int) -> tuple[float, ...]:
    value = f.get(name)
    if value is None:
        return (1.0,) * count
    if (
        not isinstance(value, list)
        or len(value) != count
        or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in value)
    ):
        raise ValueError(f"FalconH1 config.json: field {name!r} must be a list of {count} numbers, got {value!r}")
    return tuple(float(v) for v in value)


@dataclass(frozen=True)
class FalconH1Config:
    """The Falcon-H1 hyper-parameters our implementation uses, parsed from config.json."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
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
    mamba_d_ssm: int
    mamba_n_heads: int
    mamba_d_head: int
    mamba_d_state: int
    mamba_n_groups: int
    mamba_d_conv: int
    mamba_chunk_size: int
    mamba_conv_bias: bool
    mamba_proj_bias: bool
    projectors_bias: bool
    mamba_rms_norm: bool
    mamba_norm_before_gate: bool
    time_step_limit: tuple[float, float]
    embedding_multiplier: float
    lm_head_multiplier: float
    mlp_multipliers: tuple[float, float]
    key_multiplier: float
    attention_in_multiplier: float
    attention_out_multiplier: float
    ssm_in_multiplier: float
    ssm_out_multiplier: float
    ssm_multipliers: tuple[float, float, float, float, float]

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> FalconH1Config:
        """Parse a raw config.json dict."""
        f = ConfigFields(raw, "FalconH1")
        hidden = f.int("hidden_size")
        heads = f.int("num_attention_heads", default=32)
        d_ssm = f.get("mamba_d_ssm")
        width = f.int("mamba_d_ssm") if d_ssm is not None else f.int("mamba_expand", default=2) * hidden
        mamba_heads = f.int("mamba_n_heads", default=128)
        mlp = _multipliers(f, "mlp_multipliers", 2)
        ssm = _multipliers(f, "ssm_multipliers", 5)
        return cls(
            vocab_size=f.int("vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=f.int("num_hidden_layers", default=32),
            intermediate_size=f.int("intermediate_size", default=14336),
            hidden_act=f.str("hidden_act", default="silu") or "silu",
            mlp_bias=f.bool("mlp_bias", default=False),
            num_attention_heads=heads,
            num_key_value_heads=f.int("num_key_value_heads", default=heads),
            head_dim=f.int("head_dim", default=hidden // heads),
            attention_bias=f.bool("attention_bias", default=False),
            rope=rope_settings(f, default_theta=10000.0),
            rms_norm_eps=f.float("rms_norm_eps", default=1e-5),
            tie_word_embeddings=f.bool("tie_word_embeddings", default=False),
            mamba_d_ssm=width,
            mamba_n_heads=mamba_heads,
            mamba_d_head=mamba_head_dim(f, width, mamba_heads),
            mamba_d_state=f.int("mamba_d_state", default=256),
            mamba_n_groups=f.int("mamba_n_groups", default=1),
            mamba_d_conv=f.int("mamba_d_conv", default=4),
            mamba_chunk_size=f.int("mamba_chunk_size", default=256),
            mamba_conv_bias=f.bool("mamba_conv_bias", default=True),
            mamba_proj_bias=f.bool("mamba_proj_bias", default=False),
            projectors_bias=f.bool("projectors_bias", default=False),
            mamba_rms_norm=f.bool("mamba_rms_norm", default=False),
            mamba_norm_before_gate=f.bool("mamba_norm_before_gate", default=True),
            time_step_limit=f.float_pair("time_step_limit", default=(0.0, float("inf"))),
            embedding_multiplier=f.float("embedding_multiplier", default=1.0),
            lm_head_multiplier=f.float("lm_head_multiplier", default=1.0),
            mlp_multipliers=(mlp[0], mlp[1]),
            key_multiplier=f.float("key_multiplier", default=1.0),
            attention_in_multiplier=f.float("attention_in_multiplier", default=1.0),
            attention_out_multiplier=f.float("attention_out_multiplier", default=1.0),
            ssm_in_multiplier=f.float("ssm_in_multiplier", default=1.0),
            ssm_out_multiplier=f.float("ssm_out_multiplier", default=1.0),
            ssm_multipliers=(ssm[0], ssm[1], ssm[2], ssm[3], ssm[4]),
        )


class FalconH1Attention(nn.Module):
    """q/k/v/o projections with K scaled by `key_multiplier` before rope, over the paged KV pool."""

    def __init__(self, cfg: FalconH1Config, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_key_value_heads ({self.num_kv_heads}) must divide num_attention_heads ({self.num_heads})"
            )
        self.head_dim = hd
        self.key_multiplier = cfg.key_multiplier
        self.q_proj = Linear(h, self.num_heads * hd, cfg.attention_bias, device, dtype)
        self.k_proj = Linear(h, self.num_kv_heads * hd, cfg.attention_bias, device, dtype)
        self.v_proj = Linear(h, self.num_kv_heads * hd, cfg.attention_bias, device, dtype)
        self.o_proj = Linear(self.num_heads * hd, h, cfg.attention_bias, device, dtype)
        self.rotary: PartialRotaryEmbedding = cfg.rope.rotary(hd, device)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim) * self.key_multiplier
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(q, k, batch.positions)
        out = paged_attend(q, k, v, batch, k_cache, v_cache, self.head_dim**-0.5)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class FalconH1Layer(nn.Module):
    """One decoder layer: `mamba` and `self_attn` in parallel on the same normed input (HF names)."""

    def __init__(self, cfg: FalconH1Config, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, device, dtype)
        self.pre_ff_layernorm = RMSNorm(h, cfg.rms_norm_eps, device, dtype)
        self.feed_forward = GatedMLP(
            h,
            cfg.intermediate_size,
            cfg.hidden_act,
            cfg.mlp_bias,
            device,
            dtype,
            gate_multiplier=cfg.mlp_multipliers[0],
            down_multiplier=cfg.mlp_multipliers[1],
        )
        self.self_attn = FalconH1Attention(cfg, device, dtype)
        self.mamba = FalconH1Mixer(
            hidden_size=h,
            intermediate_size=cfg.mamba_d_ssm,
            num_heads=cfg.mamba_n_heads,
            head_dim=cfg.mamba_d_head,
            state_size=cfg.mamba_d_state,
            n_groups=cfg.mamba_n_groups,
            conv_kernel=cfg.mamba_d_conv,
            chunk_size=cfg.mamba_chunk_size,
            device=device,
            dtype=dtype,
            dt_limit=cfg.time_step_limit,
            conv_bias=cfg.mamba_conv_bias,
            in_proj_bias=cfg.mamba_proj_bias,
            out_proj_bias=cfg.projectors_bias,
            ssm_in_multiplier=cfg.ssm_in_multiplier,
            ssm_multipliers=cfg.ssm_multipliers,
            norm_eps=cfg.rms_norm_eps if cfg.mamba_rms_norm else None,
            norm_before_gate=cfg.mamba_norm_before_gate,
        )


class _Backbone(nn.Module):
    def __init__(self, embed_tokens: VocabEmbedding, layers: list[FalconH1Layer], final_layernorm: RMSNorm) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.final_layernorm = final_layernorm


class FalconH1ForCausalLM(nn.Module):
    """Falcon-H1 as a `HybridModel`. Parameters are allocated uninitialised; call `load_weights`."""

    def __init__(self, cfg: FalconH1Config, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = cfg
        self.dtype = dtype
        self.vocab_size = cfg.vocab_size
        layers = [FalconH1Layer(cfg, device, dtype) for _ in range(cfg.num_hidden_layers)]
        embed = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, device, dtype, multiplier=cfg.embedding_multiplier)
        self.model = _Backbone(embed, layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype))
        self.lm_head = LMHead(
            cfg.vocab_size,
            cfg.hidden_size,
            device,
            dtype,
            tied_to=embed if cfg.tie_word_embeddings else None,
        )

    @classmethod
    def from_hf_config(
        cls, raw: Mapping[str, Any], device: torch.device | str, dtype: torch.dtype
    ) -> FalconH1ForCausalLM:
        """Build the (uninitialised) model from a raw config.json dict."""
        return cls(FalconH1Config.from_hf(raw), device, dtype)

    def kv_spec(self) -> KVSpec:
        """KV pool shape: one entry per layer (every layer has attention)."""
        return KVSpec(self.config.num_hidden_layers, self.config.num_key_value_heads, self.config.head_dim, self.dtype)

    def state_spec(self) -> StateSpec:
        """State pool shape: "conv" and "ssm" per layer (every layer has a Mamba2 mixer)."""
        return StateSpec(tuple(layer.mamba.state_components() for layer in self.model.layers))

    def forward(self, batch: ForwardBatch, kv: KVPool, state: StatePool) -> torch.Tensor:
        """Logits [B, vocab] (float32) of each sequence's last new token; updates the pools."""
        n = self.config.num_hidden_layers
        check_batch(batch, kv, state, n, n)
        cfg = self.config
        with torch.inference_mode():
            h = self.model.embed_tokens(batch.input_ids)
            for i, layer in enumerate(self.model.layers):
                x = layer.input_layernorm(h)
                mamba = layer.mamba(x, batch, state.tensors[i]) * cfg.ssm_out_multiplier
                attn_in = x * cfg.attention_in_multiplier
                attn = layer.self_attn(attn_in, batch, kv.k[i], kv.v[i]) * cfg.attention_out_multiplier
                h = h + (mamba + attn)
                h = h + layer.feed_forward(layer.pre_ff_layernorm(h))
            last = h.index_select(0, batch.last_token_index.to(h.device))
            logits = self.lm_head(self.model.final_layernorm(last))
            return logits * cfg.lm_head_multiplier if cfg.lm_head_multiplier != 1.0 else logits

    def _resolve(self, hf_name: str) -> WeightTarget | None:
        if hf_name == "lm_head.weight" and self.lm_head.is_tied:
            return None
        if hf_name.endswith(("rotary_emb.inv_freq", "mamba.mup_vector")):
            return None
        return WeightTarget(hf_name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; raises ValueError naming missing or unexpected weights."""
        load_named_weights(self, weights, self._resolve)
