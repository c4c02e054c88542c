"""Falcon-H1 (`FalconH1ForCausalLM`): attention and Mamba2 side by side in every layer, then an MLP.

Matches transformers 5.23's modeling_falcon_h1: embeddings times `embedding_multiplier`; each layer
is `x = input_layernorm(h)`, `h += mamba(x) * ssm_out_multiplier + attn(x * attention_in_multiplier)
* attention_out_multiplier`, then `h += feed_forward(pre_ff_layernorm(h))` with the MLP's
`mlp_multipliers`; K is scaled by `key_multiplier` before rope (and cached scaled); logits are
multiplied by `lm_head_multiplier`. Every layer owns one KV layer and one state layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.layers.falcon_h1_mixer import FalconH1Mixer
from himamba.services.worker.layers.gated_mlp import GatedMLP
from himamba.services.worker.layers.norm import RMSNorm
from himamba.services.worker.layers.partial_rotary import PartialRotaryEmbedding
from himamba.services.worker.layers.projected_attention import ProjectedAttention
from himamba.services.worker.models.hf_config import ConfigFields
from himamba.services.worker.models.hybrid_decoder import HybridDecoderLM, PoolSizes, StackNames
from himamba.services.worker.models.mamba2_fields import Mamba2Fields
from himamba.services.worker.models.rope_params import RopeSettings, rope_settings
from himamba.services.worker.pools import KVPool, StatePool


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
    mamba: Mamba2Fields  # `width` is mamba_d_ssm
    projectors_bias: bool
    mamba_rms_norm: bool
    mamba_norm_before_gate: bool
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
            rope=rope_settings(f, default_theta=10000.0, reads_partial=False),
            rms_norm_eps=f.float("rms_norm_eps", default=1e-5),
            tie_word_embeddings=f.bool("tie_word_embeddings", default=False),
            mamba=Mamba2Fields.parse(f, width),
            projectors_bias=f.bool("projectors_bias", default=False),
            mamba_rms_norm=f.bool("mamba_rms_norm", default=False),
            mamba_norm_before_gate=f.bool("mamba_norm_before_gate", default=True),
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


class FalconH1Attention(ProjectedAttention):
    """q/k/v/o projections with K scaled by `key_multiplier` before rope."""

    def __init__(self, cfg: FalconH1Config, device: torch.device, dtype: torch.dtype) -> None:
        h, hd = cfg.hidden_size, cfg.head_dim
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        super().__init__(h, h, heads, kv_heads, hd, cfg.attention_bias, device, dtype)
        self.key_multiplier = cfg.key_multiplier
        self.rotary: PartialRotaryEmbedding = cfg.rope.rotary(hd, device)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        q, k, v = self.split_heads(*self.project_qkv(x))
        q, k = self.rotary(q, k * self.key_multiplier, batch.positions)
        return self.o_proj(self.attend(q, k, v, batch, k_cache, v_cache, self.head_dim**-0.5))


class FalconH1Layer(nn.Module):
    """One decoder layer: `mamba` and `self_attn` in parallel on the same normed input (HF names);
    `pool_index` is its entry in both pools (every layer has both mixers)."""

    def __init__(self, cfg: FalconH1Config, pool_index: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.pool_index = pool_index
        self.ssm_out_multiplier = cfg.ssm_out_multiplier
        self.attention_in_multiplier = cfg.attention_in_multiplier
        self.attention_out_multiplier = cfg.attention_out_multiplier
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
            intermediate_size=cfg.mamba.width,
            num_heads=cfg.mamba.n_heads,
            head_dim=cfg.mamba.d_head,
            state_size=cfg.mamba.d_state,
            n_groups=cfg.mamba.n_groups,
            conv_kernel=cfg.mamba.d_conv,
            chunk_size=cfg.mamba.chunk_size,
            device=device,
            dtype=dtype,
            dt_limit=cfg.mamba.time_step_limit,
            conv_bias=cfg.mamba.conv_bias,
            in_proj_bias=cfg.mamba.proj_bias,
            out_proj_bias=cfg.projectors_bias,
            ssm_in_multiplier=cfg.ssm_in_multiplier,
            ssm_multipliers=cfg.ssm_multipliers,
            norm_eps=cfg.rms_norm_eps if cfg.mamba_rms_norm else None,
            norm_before_gate=cfg.mamba_norm_before_gate,
        )

    def recurrent_mixer(self) -> FalconH1Mixer:
        return self.mamba

    def step(self, h: torch.Tensor, batch: ForwardBatch, kv: KVPool, state: StatePool) -> torch.Tensor:
        i = self.pool_index
        x = self.input_layernorm(h)
        mamba = self.mamba(x, *state.layer(i, batch)) * self.ssm_out_multiplier
        attn_in = x * self.attention_in_multiplier
        attn = self.self_attn(attn_in, batch, kv.k[i], kv.v[i]) * self.attention_out_multiplier
        h = h + (mamba + attn)
        return h + self.feed_forward(self.pre_ff_layernorm(h))


class FalconH1ForCausalLM(HybridDecoderLM):
    """Falcon-H1 as a `HybridModel`. Parameters are allocated uninitialised; call `load_weights`."""

    config_type = FalconH1Config
    stack_names = StackNames(embed="embed_tokens", final_norm="final_layernorm")
    skipped_suffixes = ("rotary_emb.inv_freq", "mamba.mup_vector")

    def __init__(self, cfg: FalconH1Config, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__(cfg, dtype)
        device = torch.device(device)
        n = cfg.num_hidden_layers
        self.attach_stack(
            [FalconH1Layer(cfg, i, device, dtype) for i in range(n)],
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype),
            device,
            PoolSizes(attention=n, recurrent=n),
            embedding_multiplier=cfg.embedding_multiplier,
        )

    def logits(self, last: torch.Tensor) -> torch.Tensor:
        logits = super().logits(last)
        multiplier = self.config.lm_head_multiplier
        return logits * multiplier if multiplier != 1.0 else logits
