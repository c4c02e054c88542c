"""transformers as the reference: tiny random checkpoints of every family saved by `save_pretrained`,
and its outputs.

Every parameter is perturbed away from its init constant before saving (norm weights, D, biases,
router correction bias), so a swapped or skipped parameter cannot hide behind a value of 1 or 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

HF_VOCAB = 512


def _perturb(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point():
                continue
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith(("norm.weight", "norm_f.weight", "layernorm.weight", ".D")):
                p.add_(0.1 * noise)
            elif name.endswith(("bias", "e_score_correction_bias")) and "dt_bias" not in name:
                p.copy_(0.05 * noise)


# The tiny configs, by transformers architecture (`<name>Config`, `<name>ForCausalLM`); `save_tiny`
# adds HF_VOCAB and special token ids 0.
TINY_CONFIGS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        # Every NemotronH layer kind (MoE with latent projections and group routing).
        "NemotronH": MappingProxyType(
            {
                "hidden_size": 64,
                "layers_block_type": [
                    "linear_attention",
                    "moe",
                    "full_attention",
                    "mlp",
                    "linear_attention",
                    "full_attention",
                ],
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "intermediate_size": 96,
                "mamba_num_heads": 8,
                "mamba_head_dim": 16,
                "ssm_state_size": 16,
                "n_groups": 2,
                "chunk_size": 16,
                "n_routed_experts": 8,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "moe_shared_expert_intermediate_size": 48,
                "moe_latent_size": 32,
                "n_group": 2,
                "topk_group": 1,
                "routed_scaling_factor": 2.5,
            }
        ),
        # A dense Granite-4.0-H with rope, GQA and non-trivial multipliers.
        "GraniteMoeHybrid": MappingProxyType(
            {
                "hidden_size": 64,
                "num_hidden_layers": 4,
                "layer_types": ["mamba", "attention", "mamba", "attention"],
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "shared_intermediate_size": 96,
                "intermediate_size": 32,
                "num_local_experts": 0,
                "mamba_n_heads": 8,
                "mamba_d_state": 16,
                "mamba_n_groups": 2,
                "mamba_chunk_size": 16,
                "position_embedding_type": "rope",
                "embedding_multiplier": 12.0,
                "residual_multiplier": 0.22,
                "attention_multiplier": 0.0625,
                "logits_scaling": 4.0,
            }
        ),
        # Bamba with two attention layers (partial rope, GQA) among Mamba2 layers of two groups.
        "Bamba": MappingProxyType(
            {
                "hidden_size": 64,
                "intermediate_size": 96,
                "num_hidden_layers": 4,
                "attn_layer_indices": [1, 3],
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "mamba_n_heads": 8,
                "mamba_d_state": 16,
                "mamba_n_groups": 2,
                "mamba_chunk_size": 16,
            }
        ),
        # FalconH1 (attention and Mamba2 in parallel in every layer) with non-trivial muP multipliers.
        "FalconH1": MappingProxyType(
            {
                "hidden_size": 64,
                "intermediate_size": 96,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "mamba_d_ssm": 96,
                "mamba_n_heads": 6,
                "mamba_d_state": 16,
                "mamba_n_groups": 2,
                "mamba_chunk_size": 16,
                "mamba_rms_norm": True,
                "mamba_norm_before_gate": False,
                "embedding_multiplier": 2.5,
                "lm_head_multiplier": 0.7,
                "mlp_multipliers": [1.3, 0.6],
                "key_multiplier": 0.8,
                "attention_in_multiplier": 1.2,
                "attention_out_multiplier": 0.9,
                "ssm_multipliers": [1.1, 0.9, 1.2, 0.8, 1.05],
                "ssm_in_multiplier": 1.15,
                "ssm_out_multiplier": 0.85,
            }
        ),
        # Qwen3-Next: gated DeltaNet (Hv = 2 Hk) and gated attention, MoE with a gated shared expert.
        "Qwen3Next": MappingProxyType(
            {
                "hidden_size": 64,
                "intermediate_size": 96,
                "num_hidden_layers": 4,
                "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "linear_conv_kernel_dim": 4,
                "linear_key_head_dim": 16,
                "linear_value_head_dim": 16,
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 4,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [2],
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 48,
                "num_experts": 8,
                "num_experts_per_tok": 2,
            }
        ),
        # A pure Mamba2 LM (no attention layer at all).
        "Mamba2": MappingProxyType(
            {
                "hidden_size": 64,
                "num_hidden_layers": 3,
                "num_heads": 8,
                "head_dim": 16,
                "state_size": 16,
                "n_groups": 2,
                "chunk_size": 16,
            }
        ),
        # Zamba2 with two shared transformer blocks used at three depths, adapters and rope.
        "Zamba2": MappingProxyType(
            {
                "hidden_size": 64,
                "intermediate_size": 96,
                "num_hidden_layers": 6,
                "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid", "mamba", "hybrid"],
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "mamba_d_state": 16,
                "n_mamba_heads": 4,
                "mamba_ngroups": 1,
                "chunk_size": 16,
                "num_mem_blocks": 2,
                "use_shared_attention_adapter": True,
                "adapter_rank": 8,
                "use_mem_rope": True,
            }
        ),
        # LFM2: short-conv layers and attention layers with q/k norms.
        "Lfm2": MappingProxyType(
            {
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 4,
                "full_attn_idxs": [1, 3],
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "conv_L_cache": 3,
                "block_multiple_of": 32,
            }
        ),
        # Jamba: Mamba1 layers with inner norms, one attention layer, MoE every other layer.
        "Jamba": MappingProxyType(
            {
                "hidden_size": 32,
                "intermediate_size": 48,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "attn_layer_period": 4,
                "attn_layer_offset": 2,
                "expert_layer_period": 2,
                "expert_layer_offset": 1,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "mamba_d_state": 8,
                "mamba_d_conv": 4,
                "mamba_expand": 2,
            }
        ),
    }
)
_SPECIAL_IDS = MappingProxyType({"eos_token_id": 0, "bos_token_id": 0, "pad_token_id": 0})

# Per family, overrides of its tiny config that move every dimension transformers reads away from its
# default and from what the tiny config derives: explicit head dims (not hidden / heads), KV heads,
# every intermediate size, norm epsilons large enough to matter, rope theta, scaling type and partial
# rotary, conv kernels, chunk sizes, biases, activations, tied heads. `save_varied` writes them.
VARIED_CONFIGS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "NemotronH": {
            "head_dim": 24,
            "num_key_value_heads": 1,
            "intermediate_size": 80,
            "moe_intermediate_size": 24,
            "moe_shared_expert_intermediate_size": 40,
            "layer_norm_epsilon": 0.02,
            "mamba_num_heads": 6,
            "mamba_head_dim": 12,
            "ssm_state_size": 8,
            "n_groups": 3,
            "conv_kernel": 3,
            "chunk_size": 8,
            "use_conv_bias": False,
            "use_bias": True,
            "mlp_bias": True,
            "mlp_hidden_act": "silu",
            "mamba_hidden_act": "gelu",
            "time_step_min": 0.01,
            "tie_word_embeddings": True,
            "n_routed_experts": 6,
            "num_experts_per_tok": 3,
            "n_group": 3,
            "topk_group": 2,
            "norm_topk_prob": False,
            "routed_scaling_factor": 1.7,
            "moe_latent_size": 40,
        },
        "GraniteMoeHybrid": {
            "head_dim": 24,
            "num_key_value_heads": 1,
            "rms_norm_eps": 0.02,
            "rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0},
            "mamba_expand": 3,
            "mamba_n_heads": 8,
            "mamba_d_head": 24,
            "mamba_d_state": 8,
            "mamba_n_groups": 4,
            "mamba_d_conv": 3,
            "mamba_chunk_size": 8,
            "mamba_conv_bias": False,
            "mamba_proj_bias": True,
            "time_step_limit": (0.01, 0.3),
            "hidden_act": "gelu",
            "shared_intermediate_size": 80,
            "intermediate_size": 24,
            "num_local_experts": 4,
            "num_experts_per_tok": 3,
            "attention_bias": True,
            "tie_word_embeddings": True,
        },
        "Bamba": {
            "head_dim": 24,
            "num_key_value_heads": 1,
            "rms_norm_eps": 0.02,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 500.0,
                "partial_rotary_factor": 0.75,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 16.0,
            },
            "mamba_expand": 3,
            "mamba_n_heads": 8,
            "mamba_d_head": 24,
            "mamba_d_state": 8,
            "mamba_n_groups": 4,
            "mamba_d_conv": 3,
            "mamba_chunk_size": 8,
            "mamba_conv_bias": False,
            "mamba_proj_bias": True,
            "time_step_limit": (0.01, 0.3),
            "hidden_act": "gelu",
            "intermediate_size": 80,
            "mlp_bias": True,
            "attention_bias": True,
            "tie_word_embeddings": True,
        },
        "FalconH1": {
            "head_dim": 24,
            "num_key_value_heads": 1,
            "rms_norm_eps": 0.02,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 500.0,
                "factor": 3.0,
                "original_max_position_embeddings": 48,
                "attention_factor": 1.3,
            },
            "mamba_d_ssm": 96,
            "mamba_n_heads": 8,
            "mamba_d_head": 12,
            "mamba_d_state": 8,
            "mamba_n_groups": 4,
            "mamba_d_conv": 3,
            "mamba_chunk_size": 8,
            "mamba_conv_bias": False,
            "mamba_proj_bias": True,
            "time_step_limit": (0.01, 0.3),
            "hidden_act": "gelu",
            "intermediate_size": 80,
            "mlp_bias": True,
            "attention_bias": True,
            "projectors_bias": True,
            "tie_word_embeddings": True,
        },
        "Qwen3Next": {
            "head_dim": 24,
            "num_key_value_heads": 1,
            "rms_norm_eps": 0.02,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500.0,
                "partial_rotary_factor": 0.5,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            "linear_key_head_dim": 12,
            "linear_value_head_dim": 20,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 6,
            "linear_conv_kernel_dim": 3,
            "intermediate_size": 80,
            "moe_intermediate_size": 24,
            "shared_expert_intermediate_size": 40,
            "num_experts": 6,
            "num_experts_per_tok": 3,
            "norm_topk_prob": False,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [0],
            "hidden_act": "gelu",
            "attention_bias": True,
            "tie_word_embeddings": True,
        },
        "Mamba2": {
            "expand": 3,
            "num_heads": 8,
            "head_dim": 24,
            "state_size": 8,
            "n_groups": 4,
            "conv_kernel": 3,
            "chunk_size": 8,
            "layer_norm_epsilon": 0.02,
            "use_bias": True,
            "use_conv_bias": False,
            "time_step_limit": (0.01, 0.3),
            "hidden_act": "gelu",
            "residual_in_fp32": False,
            "tie_word_embeddings": True,
        },
        "Zamba2": {
            "attention_head_dim": 24,  # transformers derives 2 * hidden / heads (32) unless a config sets it
            "num_key_value_heads": 2,
            "use_shared_attention_adapter": False,
            "intermediate_size": 80,
            "rms_norm_eps": 0.02,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500.0,
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 2.0,
                "original_max_position_embeddings": 40,
            },
            "use_mem_rope": True,
            "time_step_min": 0.01,  # the mixer's dt clamp in prefill
            "mamba_d_state": 8,
            "n_mamba_heads": 6,
            "mamba_expand": 3,
            "mamba_ngroups": 2,
            "mamba_d_conv": 3,
            "chunk_size": 8,
            "use_conv_bias": False,
            "add_bias_linear": True,
            "hidden_act": "silu",
            "adapter_rank": 4,
            "num_mem_blocks": 2,
            "tie_word_embeddings": False,
        },
        "Lfm2": {
            "head_dim": 24,
            "num_key_value_heads": 1,
            "norm_eps": 0.02,
            "rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 3.0},
            "conv_L_cache": 4,
            "conv_bias": True,
            "intermediate_size": 128,
            "block_multiple_of": 48,
            "block_ffn_dim_multiplier": 1.5,
            "tie_word_embeddings": False,
        },
        "Jamba": {
            "head_dim": 12,
            "num_key_value_heads": 1,
            "rms_norm_eps": 0.02,
            "mamba_d_state": 4,
            "mamba_d_conv": 3,
            "mamba_expand": 3,
            "mamba_dt_rank": 5,
            "mamba_conv_bias": False,
            "mamba_proj_bias": True,
            "num_experts": 3,
            "num_experts_per_tok": 1,
            "hidden_act": "gelu",
            "intermediate_size": 40,
            "attn_layer_period": 3,
            "attn_layer_offset": 1,
            "expert_layer_period": 3,
            "expert_layer_offset": 2,
            "tie_word_embeddings": True,
        },
    }
)


def save_tiny(architecture: str, out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """Save transformers' `<architecture>ForCausalLM` with its tiny config (keys in `overrides` replaced)
    and random weights; returns `out_dir`."""
    import transformers

    config = {"vocab_size": HF_VOCAB, **TINY_CONFIGS[architecture], **_SPECIAL_IDS, **overrides}
    torch.manual_seed(seed)
    model = getattr(transformers, f"{architecture}ForCausalLM")(
        getattr(transformers, f"{architecture}Config")(**config)
    )
    _perturb(model, seed)
    model.save_pretrained(out_dir)
    return Path(out_dir)


def save_varied(architecture: str, out_dir: Path, seed: int = 1) -> Path:
    """Save transformers' `<architecture>ForCausalLM` with its tiny config and VARIED_CONFIGS' overrides."""
    return save_tiny(architecture, out_dir, seed, **VARIED_CONFIGS[architecture])


def save_nemotron_h(out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """The tiny NemotronH (every layer kind)."""
    return save_tiny("NemotronH", out_dir, seed, **overrides)


def save_granite_hybrid(out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """The tiny dense Granite-4.0-H."""
    return save_tiny("GraniteMoeHybrid", out_dir, seed, **overrides)


def load_reference(model_dir: Path) -> Any:
    """The checkpoint in transformers, float32, eval mode, never stopping generation at eos."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def last_logits(model: Any, ids: list[int]) -> torch.Tensor:
    """Reference logits [V] at the last position of one prompt."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def greedy(model: Any, ids: list[int], max_new_tokens: int) -> list[int]:
    """Reference greedy continuation (explicit all-ones mask: pad id 0 may occur in the prompt)."""
    input_ids = torch.tensor([ids])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
    )
    return out[0, len(ids) :].tolist()


def greedy_with_logits(model: Any, ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Reference greedy continuation and its raw logits per step [max_new_tokens, V]."""
    input_ids = torch.tensor([ids])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[0, len(ids) :].tolist(), torch.stack([s[0] for s in out.logits]).float()
