"""config.json contents for the demo checkpoints, in the schema transformers 5.23 writes except for the
layer-type names: we write the older ones ("mamba", "attention", as published checkpoints do), which
every transformers release since 5.12 (the version sglang pins) reads; 5.12 rejects the newer
"linear_attention" / "full_attention" that 5.23 writes, and 5.23 maps the older ones onto them.

Written without importing transformers (the server never imports it); tests load the result
with transformers to keep the two in step. Non-finite floats use transformers' tag form.
"""

from __future__ import annotations

from typing import Any

TRANSFORMERS_VERSION = "5.23.0"
# Our demo tokenizer's end-of-text token; also used as bos and pad.
_EOS_ID = 0


def _nemotron_h_shape(preset: str) -> dict[str, Any]:
    if preset == "tiny":
        return {
            "hidden_size": 64,
            "layers_block_type": ["mamba", "mlp", "attention", "mlp", "mamba", "moe"],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "intermediate_size": 128,
            "mamba_num_heads": 8,
            "mamba_head_dim": 16,
            "ssm_state_size": 16,
            "n_groups": 2,
            "chunk_size": 32,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "moe_shared_expert_intermediate_size": 64,
        }
    if preset == "medium":
        pattern = "M-M*M-M*"
        kinds = {"M": "mamba", "-": "mlp", "*": "attention"}
        return {
            "hidden_size": 512,
            "layers_block_type": [kinds[c] for c in pattern],
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "intermediate_size": 1536,
            "mamba_num_heads": 16,
            "mamba_head_dim": 64,
            "ssm_state_size": 64,
            "n_groups": 2,
            "chunk_size": 128,
            # No MoE layer in this preset; these only fill the schema.
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 512,
            "moe_shared_expert_intermediate_size": 512,
        }
    raise ValueError(f"preset must be 'tiny' or 'medium' for nemotron_h, got {preset!r}")


def nemotron_h_config(preset: str, vocab_size: int) -> dict[str, Any]:
    """A `NemotronHForCausalLM` config.json dict."""
    shape = _nemotron_h_shape(preset)
    config: dict[str, Any] = {
        "architectures": ["NemotronHForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": _EOS_ID,
        "conv_kernel": 4,
        "dtype": "float32",
        "eos_token_id": _EOS_ID,
        "expand": 2,
        "hidden_dropout": 0.0,
        "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05,
        "mamba_hidden_act": "silu",
        "mamba_proj_bias": False,
        "mamba_ssm_cache_dtype": "float32",
        "max_position_embeddings": 4096,
        "mlp_bias": False,
        "mlp_hidden_act": "relu2",
        "model_type": "nemotron_h",
        "moe_latent_size": None,
        "moe_shared_expert_overlap": True,
        "mtp_layers_block_type": ["attention", "moe"],
        "n_group": 1,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_logits_to_keep": 1,
        "num_nextn_predict_layers": 0,
        "output_router_logits": False,
        "pad_token_id": _EOS_ID,
        "rescale_prenorm_residual": True,
        "residual_in_fp32": False,
        "routed_scaling_factor": 1.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "time_step_floor": 0.0001,
        "time_step_limit": [0.0, {"__float__": "Infinity"}],
        "time_step_max": 0.1,
        "time_step_min": 0.001,
        "topk_group": 1,
        "transformers_version": TRANSFORMERS_VERSION,
        "use_bias": False,
        "use_cache": True,
        "use_conv_bias": True,
        "use_mamba_kernels": True,
        "vocab_size": vocab_size,
    }
    config.update(shape)
    return dict(sorted(config.items()))


def granite_hybrid_config(preset: str, vocab_size: int) -> dict[str, Any]:
    """A `GraniteMoeHybridForCausalLM` (Granite-4.0-H, dense) config.json dict."""
    if preset != "tiny":
        raise ValueError(f"preset must be 'tiny' for granite_hybrid, got {preset!r}")
    layer_types = ["mamba", "attention", "mamba", "mamba"]
    config: dict[str, Any] = {
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        # Granite scales attention by 1/head_dim, not 1/sqrt(head_dim).
        "attention_multiplier": 0.0625,
        "bos_token_id": _EOS_ID,
        "dtype": "float32",
        "embedding_multiplier": 12.0,
        "eos_token_id": _EOS_ID,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "layer_types": layer_types,
        "logits_scaling": 4.0,
        "mamba_chunk_size": 32,
        "mamba_conv_bias": True,
        "mamba_d_conv": 4,
        "mamba_d_head": 16,
        "mamba_d_state": 16,
        "mamba_expand": 2,
        "mamba_n_groups": 1,
        "mamba_n_heads": 8,
        "mamba_proj_bias": False,
        "max_position_embeddings": 4096,
        "model_type": "granitemoehybrid",
        "num_attention_heads": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": len(layer_types),
        "num_key_value_heads": 2,
        "num_local_experts": 0,
        "output_router_logits": False,
        "pad_token_id": _EOS_ID,
        "position_embedding_type": "rope",
        "residual_multiplier": 0.22,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "router_aux_loss_coef": 0.001,
        "shared_intermediate_size": 128,
        "tie_word_embeddings": False,
        "time_step_limit": [0.0, {"__float__": "Infinity"}],
        "transformers_version": TRANSFORMERS_VERSION,
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    return dict(sorted(config.items()))


def generation_config(config: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json as transformers derives it from a model config."""
    out: dict[str, Any] = {"_from_model_config": True}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if config.get(key) is not None:
            out[key] = config[key]
    out.update({"output_attentions": False, "output_hidden_states": False})
    out["transformers_version"] = TRANSFORMERS_VERSION
    out["use_cache"] = True
    return out
