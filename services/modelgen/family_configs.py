"""config.json contents for the demo checkpoints of the issue-8 families (Bamba, FalconH1, Qwen3-Next,
Mamba2, Zamba2, LFM2, Jamba), in the schema transformers 5.23 writes for them, with the layer-type names
every release since 5.12 reads (Zamba2's "mamba"; see hf_configs).

Written without importing transformers; tests load each with transformers and compare it with what
transformers writes back. Only the "tiny" preset exists for these families.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType
from typing import Any

from himamba.services.modelgen.hf_configs import TRANSFORMERS_VERSION

_EOS_ID = 0


def _infinity() -> dict[str, str]:
    """transformers' tagged form of a non-finite float in config.json."""
    return {"__float__": "Infinity"}


def _base(architecture: str, model_type: str, vocab_size: int) -> dict[str, Any]:
    return {
        "architectures": [architecture],
        "bos_token_id": _EOS_ID,
        "dtype": "float32",
        "eos_token_id": _EOS_ID,
        "model_type": model_type,
        "pad_token_id": _EOS_ID,
        "transformers_version": TRANSFORMERS_VERSION,
        "use_cache": True,
        "vocab_size": vocab_size,
    }


def bamba_config(vocab_size: int) -> dict[str, Any]:
    """A `BambaForCausalLM` config.json dict: 3 Mamba2 layers and one attention layer."""
    return _base("BambaForCausalLM", "bamba", vocab_size) | {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_layer_indices": [2],
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "mamba_chunk_size": 32,
        "mamba_conv_bias": True,
        "mamba_d_conv": 4,
        "mamba_d_head": 16,
        "mamba_d_state": 16,
        "mamba_expand": 2,
        "mamba_n_groups": 1,
        "mamba_n_heads": 8,
        "mamba_proj_bias": False,
        "max_position_embeddings": 262144,
        "mlp_bias": False,
        "num_attention_heads": 4,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "num_logits_to_keep": 1,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"partial_rotary_factor": 0.5, "rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False,
        "time_step_limit": [0.0, _infinity()],
        "z_loss_coefficient": 0.0,
    }


def falcon_h1_config(vocab_size: int) -> dict[str, Any]:
    """A `FalconH1ForCausalLM` config.json dict: 3 parallel attention + Mamba2 layers, muP multipliers
    of the size the published checkpoints use, no mixer norm (as Falcon-H1 ships)."""
    return _base("FalconH1ForCausalLM", "falcon_h1", vocab_size) | {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attention_in_multiplier": 1.0,
        "attention_out_multiplier": 0.94,
        "embedding_multiplier": 5.65,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "key_multiplier": 0.39,
        "lm_head_multiplier": 0.039,
        "mamba_chunk_size": 32,
        "mamba_conv_bias": True,
        "mamba_d_conv": 4,
        "mamba_d_head": 16,
        "mamba_d_ssm": 128,
        "mamba_d_state": 16,
        "mamba_expand": 2,
        "mamba_n_groups": 1,
        "mamba_n_heads": 8,
        "mamba_norm_before_gate": True,
        "mamba_proj_bias": False,
        "mamba_rms_norm": False,
        "max_position_embeddings": 8192,
        "mlp_bias": False,
        "mlp_multipliers": [0.88, 0.59],
        "num_attention_heads": 4,
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "num_logits_to_keep": 1,
        "projectors_bias": False,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "ssm_in_multiplier": 1.25,
        "ssm_multipliers": [0.35, 0.25, 0.35, 0.5, 0.35],
        "ssm_out_multiplier": 0.24,
        "tie_word_embeddings": False,
        "time_step_limit": [0.0, _infinity()],
    }


def qwen3_next_config(vocab_size: int) -> dict[str, Any]:
    """A `Qwen3NextForCausalLM` config.json dict: 3 gated DeltaNet layers, one gated attention layer,
    MoE in every layer."""
    return _base("Qwen3NextForCausalLM", "qwen3_next", vocab_size) | {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "decoder_sparse_step": 1,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_value_head_dim": 16,
        "max_position_embeddings": 32768,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"partial_rotary_factor": 0.25, "rope_theta": 10000.0, "rope_type": "default"},
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 64,
        "tie_word_embeddings": False,
    }


def mamba2_config(vocab_size: int) -> dict[str, Any]:
    """A `Mamba2ForCausalLM` config.json dict: 4 Mamba2 layers and no attention."""
    return _base("Mamba2ForCausalLM", "mamba2", vocab_size) | {
        "chunk_size": 32,
        "conv_kernel": 4,
        "expand": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.1,
        "layer_norm_epsilon": 1e-05,
        "n_groups": 2,
        "num_heads": 8,
        "num_hidden_layers": 4,
        "rescale_prenorm_residual": False,
        "residual_in_fp32": True,
        "state_size": 16,
        "tie_word_embeddings": False,
        "time_step_floor": 0.0001,
        "time_step_limit": [0.0, _infinity()],
        "time_step_max": 0.1,
        "time_step_min": 0.001,
        "time_step_rank": 4,
        "use_bias": False,
        "use_conv_bias": True,
    }


def zamba2_config(vocab_size: int) -> dict[str, Any]:
    """A `Zamba2ForCausalLM` config.json dict: 6 Mamba2 layers, the shared transformer block (with
    LoRA adapters and rope) in front of two of them."""
    return _base("Zamba2ForCausalLM", "zamba2", vocab_size) | {
        "adapter_rank": 8,
        "add_bias_linear": False,
        "attention_dropout": 0.0,
        "attention_head_dim": 32,
        "attention_hidden_size": 128,
        "chunk_size": 32,
        "hidden_act": "gelu",
        "hidden_size": 64,
        "hybrid_layer_ids": [2, 5],
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "kv_channels": 16,
        # The older name "mamba" (see hf_configs): transformers 5.12 rejects "linear_attention" here.
        "layers_block_type": ["mamba", "mamba", "hybrid", "mamba", "mamba", "hybrid"],
        "mamba_d_conv": 4,
        "mamba_d_state": 16,
        "mamba_expand": 2,
        "mamba_headdim": 32,
        "mamba_ngroups": 1,
        "max_position_embeddings": 4096,
        "n_mamba_heads": 4,
        "num_attention_heads": 4,
        "num_hidden_layers": 6,
        "num_key_value_heads": 4,
        "num_logits_to_keep": 1,
        "num_mem_blocks": 1,
        "num_query_groups": 4,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": True,
        "time_step_floor": 0.0001,
        "time_step_max": 0.1,
        "time_step_min": 0.001,
        "use_conv_bias": True,
        "use_long_context": False,
        "use_mamba_kernels": True,
        "use_mem_eff_path": False,
        "use_mem_rope": True,
        "use_shared_attention_adapter": True,
    }


def lfm2_config(vocab_size: int) -> dict[str, Any]:
    """An `Lfm2ForCausalLM` config.json dict: 2 short-conv and 2 attention layers, tied head."""
    return _base("Lfm2ForCausalLM", "lfm2", vocab_size) | {
        "block_auto_adjust_ff_dim": True,
        "block_ffn_dim_multiplier": 1.0,
        "block_multiple_of": 64,
        "conv_L_cache": 3,
        "conv_bias": False,
        "full_attn_idxs": [1, 3],
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 192,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "max_position_embeddings": 128000,
        "norm_eps": 1e-05,
        "num_attention_heads": 4,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "tie_word_embeddings": True,
    }


def jamba_config(vocab_size: int) -> dict[str, Any]:
    """A `JambaForCausalLM` config.json dict: 3 Mamba1 layers and one attention layer, MoE (4 experts,
    top 2) every other layer."""
    return _base("JambaForCausalLM", "jamba", vocab_size) | {
        "attention_dropout": 0.0,
        "attn_layer_offset": 2,
        "attn_layer_period": 4,
        "expert_layer_offset": 1,
        "expert_layer_period": 2,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "mamba_conv_bias": True,
        "mamba_d_conv": 4,
        "mamba_d_state": 16,
        "mamba_dt_rank": 4,
        "mamba_expand": 2,
        "mamba_proj_bias": False,
        "max_position_embeddings": 262144,
        "num_attention_heads": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False,
        "use_associative_scan": True,
        "use_mamba_kernels": True,
        "use_mambapy": False,
    }


FAMILY_CONFIGS: MappingProxyType[str, Callable[[int], dict[str, Any]]] = MappingProxyType(
    {
        "bamba": bamba_config,
        "falcon_h1": falcon_h1_config,
        "qwen3_next": qwen3_next_config,
        "mamba2": mamba2_config,
        "zamba2": zamba2_config,
        "lfm2": lfm2_config,
        "jamba": jamba_config,
    }
)


def family_config(arch: str, vocab_size: int) -> dict[str, Any]:
    """The tiny-preset config.json dict of `arch`, keys sorted as transformers writes them."""
    if arch not in FAMILY_CONFIGS:
        raise ValueError(f"arch must be one of {tuple(FAMILY_CONFIGS)}, got {arch!r}")
    return dict(sorted(FAMILY_CONFIGS[arch](vocab_size).items()))
