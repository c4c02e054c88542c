"""Qwen3-Next (`Qwen3NextForCausalLM`): gated DeltaNet or gated attention, then MoE (or an MLP), per layer.

Matches transformers 5.23's modeling_qwen3_next: each layer is `h += mixer(input_layernorm(h))`
then `h += mlp(post_attention_layernorm(h))`; every RMSNorm scales by 1 + weight in float32;
attention projects q with a per-head output gate ([q | gate] per head), RMS-normalises q and k per
head, applies rope to the first `partial_rotary_factor` (0.25) of each head and multiplies the
output by sigmoid(gate); the MoE is softmax top-k over all experts (renormalised when
`norm_topk_prob`) plus a shared SwiGLU expert scaled by sigmoid(`shared_expert_gate`(x)). Layers
in `mlp_only_layers` (or all, without experts) have a dense SwiGLU MLP. `mtp.*` weights are ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.layers.gated_delta import GatedDeltaNet
from himamba.services.worker.layers.gated_mlp import GatedMLP
from himamba.services.worker.layers.linear import Linear
from himamba.services.worker.layers.moe import RoutedExperts
from himamba.services.worker.layers.offset_rms_norm import OffsetRMSNorm
from himamba.services.worker.layers.partial_rotary import PartialRotaryEmbedding
from himamba.services.worker.layers.projected_attention import ProjectedAttention
from himamba.services.worker.layers.softmax_router import SoftmaxRouter
from himamba.services.worker.models.hf_config import ConfigFields
from himamba.services.worker.models.hybrid_decoder import (
    HybridDecoderLM,
    LayerNames,
    MixerLayer,
    StackNames,
    pool_layout,
)
from himamba.services.worker.models.rope_params import RopeSettings, rope_settings

_KINDS = MappingProxyType({"linear_attention": "linear", "full_attention": "attention"})


def _int_list(f: ConfigFields, name: str) -> list[int]:
    value = f.get(name) or []
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise ValueError(f"Qwen3Next config.json: field {name!r} must be a list of integers, got {value!r}")
    return value


def _layer_kinds(f: ConfigFields, num_layers: int) -> tuple[str, ...]:
    listed = f.get("layer_types")
    if listed is None:
        interval = f.int("full_attention_interval", default=4)
        return tuple("attention" if (i + 1) % interval == 0 else "linear" for i in range(num_layers))
    if not isinstance(listed, list) or any(k not in _KINDS for k in listed) or len(listed) != num_layers:
        raise ValueError(
            f"Qwen3Next config.json: field 'layer_types' must list {num_layers} linear_attention/full_attention "
            f"layers, got {listed!r}"
        )
    return tuple(_KINDS[k] for k in listed)


@dataclass(frozen=True)
class Qwen3NextConfig:
    """The Qwen3-Next hyper-parameters our implementation uses, parsed from config.json."""

    vocab_size: int
    hidden_size: int
    layer_kinds: tuple[str, ...]  # "linear" (gated DeltaNet) | "attention"
    moe_layers: tuple[bool, ...]  # per layer: MoE (True) or dense MLP
    intermediate_size: int
    hidden_act: str
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    rope: RopeSettings
    rms_norm_eps: float
    tie_word_embeddings: bool
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    moe_intermediate_size: int
    shared_expert_intermediate_size: int

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> Qwen3NextConfig:
        """Parse a raw config.json dict (`layer_types`, or the older `full_attention_interval`)."""
        f = ConfigFields(raw, "Qwen3Next")
        num_layers = f.int("num_hidden_layers", default=48)
        heads = f.int("num_attention_heads", default=16)
        experts = f.int("num_experts", default=512)
        step = f.int("decoder_sparse_step", default=1)
        if step < 1:
            raise ValueError(f"Qwen3Next config.json: field 'decoder_sparse_step' must be >= 1, got {step}")
        mlp_only = set(_int_list(f, "mlp_only_layers"))
        return cls(
            vocab_size=f.int("vocab_size"),
            hidden_size=f.int("hidden_size"),
            layer_kinds=_layer_kinds(f, num_layers),
            moe_layers=tuple(i not in mlp_only and experts > 0 and (i + 1) % step == 0 for i in range(num_layers)),
            intermediate_size=f.int("intermediate_size", default=5632),
            hidden_act=f.str("hidden_act", default="silu") or "silu",
            num_attention_heads=heads,
            num_key_value_heads=f.int("num_key_value_heads", default=2),
            head_dim=f.int("head_dim", default=256),
            attention_bias=f.bool("attention_bias", default=False),
            rope=rope_settings(f, default_theta=10000.0, default_partial=0.25),
            rms_norm_eps=f.float("rms_norm_eps", default=1e-6),
            tie_word_embeddings=f.bool("tie_word_embeddings", default=False),
            linear_conv_kernel_dim=f.int("linear_conv_kernel_dim", default=4),
            linear_key_head_dim=f.int("linear_key_head_dim", default=128),
            linear_value_head_dim=f.int("linear_value_head_dim", default=128),
            linear_num_key_heads=f.int("linear_num_key_heads", default=16),
            linear_num_value_heads=f.int("linear_num_value_heads", default=32),
            num_experts=experts,
            num_experts_per_tok=f.int("num_experts_per_tok", default=10),
            norm_topk_prob=f.bool("norm_topk_prob", default=True),
            moe_intermediate_size=f.int("moe_intermediate_size", default=512),
            shared_expert_intermediate_size=f.int("shared_expert_intermediate_size", default=512),
        )


class Qwen3NextAttention(ProjectedAttention):
    """Gated attention: q and a per-head gate from `q_proj`, q/k RMS norms per head, partial rope,
    output times sigmoid(gate) before `o_proj`."""

    def __init__(self, cfg: Qwen3NextConfig, device: torch.device, dtype: torch.dtype) -> None:
        h, hd = cfg.hidden_size, cfg.head_dim
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        super().__init__(h, h, heads, kv_heads, hd, cfg.attention_bias, device, dtype, q_per_head=2)
        self.q_norm = OffsetRMSNorm(hd, cfg.rms_norm_eps, device, dtype)
        self.k_norm = OffsetRMSNorm(hd, cfg.rms_norm_eps, device, dtype)
        self.rotary: PartialRotaryEmbedding = cfg.rope.rotary(hd, device)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q_gate, k, v = self.project_qkv(x)
        q, gate = q_gate.view(tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(self.q_norm(q), self.k_norm(k), batch.positions)
        out = self.attend(q, k, v, batch, k_cache, v_cache, self.head_dim**-0.5)
        return self.o_proj(out * torch.sigmoid(gate.reshape(tokens, -1)))


class Qwen3NextMoE(nn.Module):
    """Routed SwiGLU experts plus a shared SwiGLU expert gated by sigmoid(shared_expert_gate(x))."""

    def __init__(self, cfg: Qwen3NextConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.gate = SoftmaxRouter(h, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob, device, dtype)
        self.experts = RoutedExperts(cfg.num_experts, h, cfg.moe_intermediate_size, cfg.hidden_act, True, device, dtype)
        self.shared_expert = GatedMLP(h, cfg.shared_expert_intermediate_size, cfg.hidden_act, False, device, dtype)
        self.shared_expert_gate = Linear(h, 1, False, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts(x, self.gate(x)) + shared


class Qwen3NextLayer(MixerLayer):
    """One decoder layer; exactly one of `linear_attn` / `self_attn` is set (HF's attribute names)."""

    names = LayerNames(
        mixer_norm="input_layernorm", recurrent="linear_attn", ffn_norm="post_attention_layernorm", ffn="mlp"
    )

    def __init__(
        self, cfg: Qwen3NextConfig, index: int, pool_index: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__(pool_index)
        self.kind = cfg.layer_kinds[index]
        h = cfg.hidden_size
        self.input_layernorm = OffsetRMSNorm(h, cfg.rms_norm_eps, device, dtype)
        self.post_attention_layernorm = OffsetRMSNorm(h, cfg.rms_norm_eps, device, dtype)
        self.linear_attn: GatedDeltaNet | None = None
        self.self_attn: Qwen3NextAttention | None = None
        if self.kind == "linear":
            self.linear_attn = GatedDeltaNet(
                hidden_size=h,
                num_k_heads=cfg.linear_num_key_heads,
                num_v_heads=cfg.linear_num_value_heads,
                head_k_dim=cfg.linear_key_head_dim,
                head_v_dim=cfg.linear_value_head_dim,
                conv_kernel=cfg.linear_conv_kernel_dim,
                norm_eps=cfg.rms_norm_eps,
                device=device,
                dtype=dtype,
                activation=cfg.hidden_act,
            )
        else:
            self.self_attn = Qwen3NextAttention(cfg, device, dtype)
        self.mlp: nn.Module = (
            Qwen3NextMoE(cfg, device, dtype)
            if cfg.moe_layers[index]
            else GatedMLP(h, cfg.intermediate_size, cfg.hidden_act, False, device, dtype)
        )


class Qwen3NextForCausalLM(HybridDecoderLM):
    """Qwen3-Next as a `HybridModel`. Parameters are allocated uninitialised; call `load_weights`."""

    supports_tensor_parallel = True
    config_type = Qwen3NextConfig
    stack_names = StackNames(embed="embed_tokens", final_norm="norm")
    skipped_prefixes = ("mtp.",)  # multi-token-prediction heads
    merges_expert_weights = True

    def __init__(self, cfg: Qwen3NextConfig, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__(cfg, dtype)
        device = torch.device(device)
        pools = pool_layout(cfg.layer_kinds, "linear")
        layers = [Qwen3NextLayer(cfg, i, pool, device, dtype) for i, pool in enumerate(pools.indices)]
        self.attach_stack(layers, OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype), device, pools.sizes)
