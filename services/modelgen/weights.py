"""Random weights for the demo checkpoints, under the HF parameter names transformers saves.

Deterministic per (seed, parameter name), so adding a layer does not reshuffle the others.
Scales follow the usual recipes, so outputs are not degenerate: linear and embedding weights
N(0, 0.02); norms 1; Mamba A_log = log U[1, 16], D = 1, dt_bias = softplus^-1 of a log-uniform
dt in [1e-3, 1e-1]; conv weights and biases U(+-1/sqrt(K)) as PyTorch initialises a Conv1d.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Literal, NamedTuple

import torch

Init = Literal["normal", "ones", "zeros", "conv", "a_log", "dt_bias"]
_STD = 0.02
_DT_MIN, _DT_MAX = 1e-3, 1e-1


class ParamSpec(NamedTuple):
    """One checkpoint tensor: HF name, shape and how to initialise it."""

    name: str
    shape: tuple[int, ...]
    init: Init
    bound: float = 0.0  # "conv": half-width of the uniform range


def _mamba_params(
    prefix: str, hidden: int, heads: int, head_dim: int, groups: int, state: int, kernel: int, conv_bias: bool
) -> list[ParamSpec]:
    inner = heads * head_dim
    conv_dim = inner + 2 * groups * state
    bound = 1.0 / math.sqrt(kernel)
    specs = [
        ParamSpec(f"{prefix}.in_proj.weight", (inner + conv_dim + heads, hidden), "normal"),
        ParamSpec(f"{prefix}.conv1d.weight", (conv_dim, 1, kernel), "conv", bound),
        ParamSpec(f"{prefix}.dt_bias", (heads,), "dt_bias"),
        ParamSpec(f"{prefix}.A_log", (heads,), "a_log"),
        ParamSpec(f"{prefix}.D", (heads,), "ones"),
        ParamSpec(f"{prefix}.norm.weight", (inner,), "ones"),
        ParamSpec(f"{prefix}.out_proj.weight", (hidden, inner), "normal"),
    ]
    if conv_bias:
        specs.append(ParamSpec(f"{prefix}.conv1d.bias", (conv_dim,), "conv", bound))
    return specs


def _attention_params(prefix: str, hidden: int, heads: int, kv_heads: int, head_dim: int) -> list[ParamSpec]:
    return [
        ParamSpec(f"{prefix}.q_proj.weight", (heads * head_dim, hidden), "normal"),
        ParamSpec(f"{prefix}.k_proj.weight", (kv_heads * head_dim, hidden), "normal"),
        ParamSpec(f"{prefix}.v_proj.weight", (kv_heads * head_dim, hidden), "normal"),
        ParamSpec(f"{prefix}.o_proj.weight", (hidden, heads * head_dim), "normal"),
    ]


def nemotron_h_params(config: dict[str, Any]) -> list[ParamSpec]:
    """Tensors of a NemotronH checkpoint (published `backbone.` prefix, per-expert MoE matrices)."""
    h = config["hidden_size"]
    specs = [ParamSpec("backbone.embeddings.weight", (config["vocab_size"], h), "normal")]
    for i, kind in enumerate(config["layers_block_type"]):
        p = f"backbone.layers.{i}"
        specs.append(ParamSpec(f"{p}.norm.weight", (h,), "ones"))
        if kind in ("mamba", "linear_attention"):
            specs += _mamba_params(
                f"{p}.mixer",
                h,
                config["mamba_num_heads"],
                config["mamba_head_dim"],
                config["n_groups"],
                config["ssm_state_size"],
                config["conv_kernel"],
                config["use_conv_bias"],
            )
        elif kind in ("attention", "full_attention"):
            specs += _attention_params(
                f"{p}.mixer", h, config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
            )
        elif kind == "mlp":
            inter = config["intermediate_size"]
            specs += [
                ParamSpec(f"{p}.mixer.up_proj.weight", (inter, h), "normal"),
                ParamSpec(f"{p}.mixer.down_proj.weight", (h, inter), "normal"),
            ]
        elif kind == "moe":
            experts, inter = config["n_routed_experts"], config["moe_intermediate_size"]
            shared = config["moe_shared_expert_intermediate_size"]
            specs += [
                ParamSpec(f"{p}.mixer.gate.weight", (experts, h), "normal"),
                ParamSpec(f"{p}.mixer.gate.e_score_correction_bias", (experts,), "zeros"),
                ParamSpec(f"{p}.mixer.shared_experts.up_proj.weight", (shared, h), "normal"),
                ParamSpec(f"{p}.mixer.shared_experts.down_proj.weight", (h, shared), "normal"),
            ]
            for e in range(experts):
                specs += [
                    ParamSpec(f"{p}.mixer.experts.{e}.up_proj.weight", (inter, h), "normal"),
                    ParamSpec(f"{p}.mixer.experts.{e}.down_proj.weight", (h, inter), "normal"),
                ]
        else:
            raise ValueError(f"layers_block_type[{i}] {kind!r} is not a NemotronH layer type")
    specs.append(ParamSpec("backbone.norm_f.weight", (h,), "ones"))
    if not config["tie_word_embeddings"]:
        specs.append(ParamSpec("lm_head.weight", (config["vocab_size"], h), "normal"))
    return specs


def granite_hybrid_params(config: dict[str, Any]) -> list[ParamSpec]:
    """Tensors of a dense Granite-4.0-H checkpoint."""
    if config["num_local_experts"] != 0:
        raise ValueError("granite_hybrid checkpoints are made dense: num_local_experts must be 0")
    h = config["hidden_size"]
    specs = [ParamSpec("model.embed_tokens.weight", (config["vocab_size"], h), "normal")]
    for i, kind in enumerate(config["layer_types"]):
        p = f"model.layers.{i}"
        specs += [
            ParamSpec(f"{p}.input_layernorm.weight", (h,), "ones"),
            ParamSpec(f"{p}.post_attention_layernorm.weight", (h,), "ones"),
            ParamSpec(f"{p}.shared_mlp.input_linear.weight", (2 * config["shared_intermediate_size"], h), "normal"),
            ParamSpec(f"{p}.shared_mlp.output_linear.weight", (h, config["shared_intermediate_size"]), "normal"),
        ]
        if kind in ("mamba", "linear_attention"):
            specs += _mamba_params(
                f"{p}.mamba",
                h,
                config["mamba_n_heads"],
                config["mamba_d_head"],
                config["mamba_n_groups"],
                config["mamba_d_state"],
                config["mamba_d_conv"],
                config["mamba_conv_bias"],
            )
        elif kind in ("attention", "full_attention"):
            head_dim = h // config["num_attention_heads"]
            specs += _attention_params(
                f"{p}.self_attn", h, config["num_attention_heads"], config["num_key_value_heads"], head_dim
            )
        else:
            raise ValueError(f"layer_types[{i}] {kind!r} is not a Granite hybrid layer type")
    specs.append(ParamSpec("model.norm.weight", (h,), "ones"))
    if not config["tie_word_embeddings"]:
        specs.append(ParamSpec("lm_head.weight", (config["vocab_size"], h), "normal"))
    return specs


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def init_tensor(spec: ParamSpec, seed: int) -> torch.Tensor:
    """A float32 tensor for `spec`, a pure function of (seed, spec)."""
    gen = _generator(seed, spec.name)
    match spec.init:
        case "normal":
            return torch.randn(spec.shape, generator=gen) * _STD
        case "ones":
            return torch.ones(spec.shape)
        case "zeros":
            return torch.zeros(spec.shape)
        case "conv":
            return (torch.rand(spec.shape, generator=gen) * 2 - 1) * spec.bound
        case "a_log":
            return torch.log(1 + 15 * torch.rand(spec.shape, generator=gen))
        case "dt_bias":
            log_dt = math.log(_DT_MIN) + torch.rand(spec.shape, generator=gen) * (math.log(_DT_MAX) - math.log(_DT_MIN))
            dt = torch.exp(log_dt)
            return dt + torch.log(-torch.expm1(-dt))  # inverse of softplus
    raise AssertionError(f"unknown init {spec.init}")


def random_weights(specs: list[ParamSpec], seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, by name."""
    return {spec.name: init_tensor(spec, seed) for spec in specs}
