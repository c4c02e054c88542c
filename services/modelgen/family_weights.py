"""Checkpoint tensors (HF names, shapes, inits) of the issue-8 families, read off their config.json.

Names are those transformers 5.23 loads; MoE experts are written stacked (`experts.gate_up_proj`
[E, 2I, H], `experts.down_proj` [E, H, I]), the layout transformers 5 keeps in memory. Inits follow
`weights.init_tensor`; Qwen3-Next's residual norms store weight - 1, so theirs are zeros.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

from himamba.services.modelgen.weights import ParamSpec


def _linear(name: str, out_features: int, in_features: int) -> ParamSpec:
    return ParamSpec(f"{name}.weight", (out_features, in_features), "normal")


def _norm(name: str, width: int, init: str = "ones") -> ParamSpec:
    return ParamSpec(f"{name}.weight", (width,), init)  # type: ignore[arg-type]


def _conv(name: str, channels: int, kernel: int, bias: bool) -> list[ParamSpec]:
    bound = 1.0 / math.sqrt(kernel)
    specs = [ParamSpec(f"{name}.weight", (channels, 1, kernel), "conv", bound)]
    if bias:
        specs.append(ParamSpec(f"{name}.bias", (channels,), "conv", bound))
    return specs


def _mamba2(
    p: str, hidden: int, inner: int, heads: int, groups: int, state: int, kernel: int, conv_bias: bool, norm: bool
) -> list[ParamSpec]:
    conv_dim = inner + 2 * groups * state
    specs = [
        _linear(f"{p}.in_proj", inner + conv_dim + heads, hidden),
        *_conv(f"{p}.conv1d", conv_dim, kernel, conv_bias),
        ParamSpec(f"{p}.dt_bias", (heads,), "dt_bias"),
        ParamSpec(f"{p}.A_log", (heads,), "a_log"),
        ParamSpec(f"{p}.D", (heads,), "ones"),
        _linear(f"{p}.out_proj", hidden, inner),
    ]
    if norm:
        specs.append(_norm(f"{p}.norm", inner))
    return specs


def _attention(p: str, hidden: int, heads: int, kv_heads: int, head_dim: int, out: str = "o_proj") -> list[ParamSpec]:
    return [
        _linear(f"{p}.q_proj", heads * head_dim, hidden),
        _linear(f"{p}.k_proj", kv_heads * head_dim, hidden),
        _linear(f"{p}.v_proj", kv_heads * head_dim, hidden),
        _linear(f"{p}.{out}", hidden, heads * head_dim),
    ]


def _gated_mlp(p: str, hidden: int, inter: int) -> list[ParamSpec]:
    return [
        _linear(f"{p}.gate_proj", inter, hidden),
        _linear(f"{p}.up_proj", inter, hidden),
        _linear(f"{p}.down_proj", hidden, inter),
    ]


def _stacked_experts(p: str, experts: int, hidden: int, inter: int) -> list[ParamSpec]:
    return [
        ParamSpec(f"{p}.gate_up_proj", (experts, 2 * inter, hidden), "normal"),
        ParamSpec(f"{p}.down_proj", (experts, hidden, inter), "normal"),
    ]


def _head(c: dict[str, Any], embed: str) -> list[ParamSpec]:
    specs = [ParamSpec(embed, (c["vocab_size"], c["hidden_size"]), "normal")]
    if not c["tie_word_embeddings"]:
        specs.append(_linear("lm_head", c["vocab_size"], c["hidden_size"]))
    return specs


def bamba_params(c: dict[str, Any]) -> list[ParamSpec]:
    """Tensors of a Bamba checkpoint."""
    h, inner = c["hidden_size"], c["mamba_expand"] * c["hidden_size"]
    head_dim = h // c["num_attention_heads"]
    specs = _head(c, "model.embed_tokens.weight") + [_norm("model.final_layernorm", h)]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        specs += [_norm(f"{p}.input_layernorm", h), _norm(f"{p}.pre_ff_layernorm", h)]
        specs += _gated_mlp(f"{p}.feed_forward", h, c["intermediate_size"])
        if i in c["attn_layer_indices"]:
            specs += _attention(f"{p}.self_attn", h, c["num_attention_heads"], c["num_key_value_heads"], head_dim)
        else:
            specs += _mamba2(
                f"{p}.mamba",
                h,
                inner,
                c["mamba_n_heads"],
                c["mamba_n_groups"],
                c["mamba_d_state"],
                c["mamba_d_conv"],
                c["mamba_conv_bias"],
                norm=True,
            )
    return specs


def falcon_h1_params(c: dict[str, Any]) -> list[ParamSpec]:
    """Tensors of a FalconH1 checkpoint (both mixers in every layer)."""
    h = c["hidden_size"]
    specs = _head(c, "model.embed_tokens.weight") + [_norm("model.final_layernorm", h)]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        specs += [_norm(f"{p}.input_layernorm", h), _norm(f"{p}.pre_ff_layernorm", h)]
        specs += _gated_mlp(f"{p}.feed_forward", h, c["intermediate_size"])
        specs += _attention(f"{p}.self_attn", h, c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"])
        specs += _mamba2(
            f"{p}.mamba",
            h,
            c["mamba_d_ssm"],
            c["mamba_n_heads"],
            c["mamba_n_groups"],
            c["mamba_d_state"],
            c["mamba_d_conv"],
            c["mamba_conv_bias"],
            norm=c["mamba_rms_norm"],
        )
    return specs


def qwen3_next_params(c: dict[str, Any]) -> list[ParamSpec]:
    """Tensors of a Qwen3-Next checkpoint (stacked experts)."""
    h, hd = c["hidden_size"], c["head_dim"]
    key_dim = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    value_dim = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    v_heads = c["linear_num_value_heads"]
    specs = _head(c, "model.embed_tokens.weight") + [_norm("model.norm", h, "zeros")]
    for i, kind in enumerate(c["layer_types"]):
        p = f"model.layers.{i}"
        specs += [_norm(f"{p}.input_layernorm", h, "zeros"), _norm(f"{p}.post_attention_layernorm", h, "zeros")]
        if kind == "linear_attention":
            a = f"{p}.linear_attn"
            specs += [
                _linear(f"{a}.in_proj_qkvz", 2 * key_dim + 2 * value_dim, h),
                _linear(f"{a}.in_proj_ba", 2 * v_heads, h),
                *_conv(f"{a}.conv1d", 2 * key_dim + value_dim, c["linear_conv_kernel_dim"], False),
                ParamSpec(f"{a}.dt_bias", (v_heads,), "ones"),
                ParamSpec(f"{a}.A_log", (v_heads,), "a_log"),
                _norm(f"{a}.norm", c["linear_value_head_dim"]),
                _linear(f"{a}.out_proj", h, value_dim),
            ]
        else:
            heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
            a = f"{p}.self_attn"
            specs += [
                _linear(f"{a}.q_proj", 2 * heads * hd, h),
                _linear(f"{a}.k_proj", kv * hd, h),
                _linear(f"{a}.v_proj", kv * hd, h),
                _linear(f"{a}.o_proj", h, heads * hd),
                _norm(f"{a}.q_norm", hd, "zeros"),
                _norm(f"{a}.k_norm", hd, "zeros"),
            ]
        if i not in c["mlp_only_layers"] and c["num_experts"] > 0 and (i + 1) % c["decoder_sparse_step"] == 0:
            specs += [_linear(f"{p}.mlp.gate", c["num_experts"], h), _linear(f"{p}.mlp.shared_expert_gate", 1, h)]
            specs += _stacked_experts(f"{p}.mlp.experts", c["num_experts"], h, c["moe_intermediate_size"])
            specs += _gated_mlp(f"{p}.mlp.shared_expert", h, c["shared_expert_intermediate_size"])
        else:
            specs += _gated_mlp(f"{p}.mlp", h, c["intermediate_size"])
    return specs


def mamba2_params(c: dict[str, Any]) -> list[ParamSpec]:
    """Tensors of a Mamba2 checkpoint (`backbone.` prefix)."""
    h = c["hidden_size"]
    specs = _head(c, "backbone.embeddings.weight") + [_norm("backbone.norm_f", h)]
    for i in range(c["num_hidden_layers"]):
        p = f"backbone.layers.{i}"
        specs.append(_norm(f"{p}.norm", h))
        specs += _mamba2(
            f"{p}.mixer",
            h,
            c["num_heads"] * c["head_dim"],
            c["num_heads"],
            c["n_groups"],
            c["state_size"],
            c["conv_kernel"],
            c["use_conv_bias"],
            norm=True,
        )
    return specs


def zamba2_params(c: dict[str, Any]) -> list[ParamSpec]:
    """Tensors of a Zamba2 checkpoint: each shared block under the first layer that uses it."""
    h, inner, inter = c["hidden_size"], c["mamba_expand"] * c["hidden_size"], c["intermediate_size"]
    attn_h, rank, blocks = 2 * h, c["adapter_rank"], c["num_mem_blocks"]
    heads = c["num_attention_heads"]
    head_dim = attn_h // heads
    hybrid = [i for i, kind in enumerate(c["layers_block_type"]) if kind == "hybrid"]
    specs = _head(c, "model.embed_tokens.weight") + [_norm("model.final_layernorm", h)]
    for i, kind in enumerate(c["layers_block_type"]):
        p = f"model.layers.{i}"
        mamba = f"{p}.mamba_decoder" if kind == "hybrid" else p
        specs.append(_norm(f"{mamba}.input_layernorm", h))
        specs += _mamba2(
            f"{mamba}.mamba",
            h,
            inner,
            c["n_mamba_heads"],
            c["mamba_ngroups"],
            c["mamba_d_state"],
            c["mamba_d_conv"],
            True,
            norm=True,
        )
        if kind != "hybrid":
            continue
        specs.append(_linear(f"{p}.linear", h, h))
        use = hybrid.index(i)
        if use >= blocks:
            continue  # a later use of a shared block: its tensors live under the first use
        t = f"{p}.shared_transformer"
        specs += [_norm(f"{t}.input_layernorm", attn_h), _norm(f"{t}.pre_ff_layernorm", h)]
        specs += [
            _linear(f"{t}.self_attn.q_proj", heads * head_dim, attn_h),
            _linear(f"{t}.self_attn.k_proj", c["num_key_value_heads"] * head_dim, attn_h),
            _linear(f"{t}.self_attn.v_proj", c["num_key_value_heads"] * head_dim, attn_h),
            _linear(f"{t}.self_attn.o_proj", h, heads * head_dim),
            _linear(f"{t}.feed_forward.gate_up_proj", 2 * inter, h),
            _linear(f"{t}.feed_forward.down_proj", h, inter),
        ]
        for j in range(use, len(hybrid), blocks):
            specs += [
                _linear(f"{t}.feed_forward.gate_up_proj_adapter_list.{j}.0", rank, h),
                _linear(f"{t}.feed_forward.gate_up_proj_adapter_list.{j}.1", 2 * inter, rank),
            ]
            if c["use_shared_attention_adapter"]:
                for name in ("q", "k", "v"):
                    specs += [
                        _linear(f"{t}.self_attn.linear_{name}_adapter_list.{j}.0", rank, attn_h),
                        _linear(f"{t}.self_attn.linear_{name}_adapter_list.{j}.1", attn_h, rank),
                    ]
    return specs


def lfm2_params(c: dict[str, Any]) -> list[ParamSpec]:
    """Tensors of an LFM2 checkpoint."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = h // heads
    inter = int(2 * c["intermediate_size"] / 3)
    inter = int(c["block_ffn_dim_multiplier"] * inter)
    inter = c["block_multiple_of"] * ((inter + c["block_multiple_of"] - 1) // c["block_multiple_of"])
    specs = _head(c, "model.embed_tokens.weight") + [_norm("model.embedding_norm", h)]
    for i, kind in enumerate(c["layer_types"]):
        p = f"model.layers.{i}"
        specs += [_norm(f"{p}.operator_norm", h), _norm(f"{p}.ffn_norm", h)]
        specs += [
            _linear(f"{p}.feed_forward.w1", inter, h),
            _linear(f"{p}.feed_forward.w3", inter, h),
            _linear(f"{p}.feed_forward.w2", h, inter),
        ]
        if kind == "conv":
            specs += [_linear(f"{p}.conv.in_proj", 3 * h, h), _linear(f"{p}.conv.out_proj", h, h)]
            specs += _conv(f"{p}.conv.conv", h, c["conv_L_cache"], c["conv_bias"])
        else:
            a = f"{p}.self_attn"
            specs += _attention(a, h, heads, c["num_key_value_heads"], head_dim, out="out_proj")
            specs += [_norm(f"{a}.q_layernorm", head_dim), _norm(f"{a}.k_layernorm", head_dim)]
    return specs


def jamba_params(c: dict[str, Any]) -> list[ParamSpec]:
    """Tensors of a Jamba checkpoint (stacked experts)."""
    h, inner, n, rank = c["hidden_size"], c["mamba_expand"] * c["hidden_size"], c["mamba_d_state"], c["mamba_dt_rank"]
    specs = _head(c, "model.embed_tokens.weight") + [_norm("model.final_layernorm", h)]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        specs += [_norm(f"{p}.input_layernorm", h), _norm(f"{p}.pre_ff_layernorm", h)]
        if i % c["attn_layer_period"] == c["attn_layer_offset"]:
            specs += _attention(
                f"{p}.self_attn", h, c["num_attention_heads"], c["num_key_value_heads"], h // c["num_attention_heads"]
            )
        else:
            m = f"{p}.mamba"
            specs += [
                _linear(f"{m}.in_proj", 2 * inner, h),
                *_conv(f"{m}.conv1d", inner, c["mamba_d_conv"], c["mamba_conv_bias"]),
                _linear(f"{m}.x_proj", rank + 2 * n, inner),
                _linear(f"{m}.dt_proj", inner, rank),
                ParamSpec(f"{m}.dt_proj.bias", (inner,), "dt_bias"),
                ParamSpec(f"{m}.A_log", (inner, n), "a_log"),
                ParamSpec(f"{m}.D", (inner,), "ones"),
                _linear(f"{m}.out_proj", h, inner),
                _norm(f"{m}.dt_layernorm", rank),
                _norm(f"{m}.b_layernorm", n),
                _norm(f"{m}.c_layernorm", n),
            ]
        if i % c["expert_layer_period"] == c["expert_layer_offset"]:
            specs.append(_linear(f"{p}.feed_forward.router", c["num_experts"], h))
            specs += _stacked_experts(f"{p}.feed_forward.experts", c["num_experts"], h, c["intermediate_size"])
        else:
            specs += _gated_mlp(f"{p}.feed_forward", h, c["intermediate_size"])
    return specs


FAMILY_PARAMS: MappingProxyType[str, Callable[[dict[str, Any]], list[ParamSpec]]] = MappingProxyType(
    {
        "bamba": bamba_params,
        "falcon_h1": falcon_h1_params,
        "qwen3_next": qwen3_next_params,
        "mamba2": mamba2_params,
        "zamba2": zamba2_params,
        "lfm2": lfm2_params,
        "jamba": jamba_params,
    }
)
