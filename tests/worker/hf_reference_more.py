"""Tiny random transformers checkpoints of the issue-8 families (Bamba, FalconH1, Qwen3-Next, Mamba2,
Zamba2, LFM2, Jamba), saved by `save_pretrained` with every parameter perturbed off its init constant
(see `hf_reference._perturb`). Each saver takes keyword overrides of its config."""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from tests.worker.hf_reference import HF_VOCAB, _perturb

_SPECIAL = MappingProxyType({"eos_token_id": 0, "bos_token_id": 0, "pad_token_id": 0})


def _save(config_cls: Any, model_cls: Any, kwargs: dict[str, Any], out_dir: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs))
    _perturb(model, seed)
    model.save_pretrained(out_dir)
    return Path(out_dir)


def save_bamba(out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """Bamba with two attention layers (partial rope, GQA) among Mamba2 layers of two groups."""
    from transformers import BambaConfig, BambaForCausalLM

    kwargs: dict[str, Any] = dict(
        vocab_size=HF_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        attn_layer_indices=[1, 3],
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=8,
        mamba_d_state=16,
        mamba_n_groups=2,
        mamba_chunk_size=16,
        **_SPECIAL,
    )
    kwargs.update(overrides)
    return _save(BambaConfig, BambaForCausalLM, kwargs, out_dir, seed)


def save_falcon_h1(out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """FalconH1 (attention and Mamba2 in parallel in every layer) with non-trivial muP multipliers."""
    from transformers import FalconH1Config, FalconH1ForCausalLM

    kwargs: dict[str, Any] = dict(
        vocab_size=HF_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_d_ssm=96,
        mamba_n_heads=6,
        mamba_d_state=16,
        mamba_n_groups=2,
        mamba_chunk_size=16,
        mamba_rms_norm=True,
        mamba_norm_before_gate=False,
        embedding_multiplier=2.5,
        lm_head_multiplier=0.7,
        mlp_multipliers=[1.3, 0.6],
        key_multiplier=0.8,
        attention_in_multiplier=1.2,
        attention_out_multiplier=0.9,
        ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.05],
        ssm_in_multiplier=1.15,
        ssm_out_multiplier=0.85,
        **_SPECIAL,
    )
    kwargs.update(overrides)
    return _save(FalconH1Config, FalconH1ForCausalLM, kwargs, out_dir, seed)


def save_qwen3_next(out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """Qwen3-Next: gated DeltaNet (Hv = 2 Hk) and gated attention, MoE with a gated shared expert."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    kwargs: dict[str, Any] = dict(
        vocab_size=HF_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        decoder_sparse_step=1,
        mlp_only_layers=[2],
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        **_SPECIAL,
    )
    kwargs.update(overrides)
    return _save(Qwen3NextConfig, Qwen3NextForCausalLM, kwargs, out_dir, seed)


def save_mamba2(out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """A pure Mamba2 LM (no attention layer at all)."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    kwargs: dict[str, Any] = dict(
        vocab_size=HF_VOCAB,
        hidden_size=64,
        num_hidden_layers=3,
        num_heads=8,
        head_dim=16,
        state_size=16,
        n_groups=2,
        chunk_size=16,
        **_SPECIAL,
    )
    kwargs.update(overrides)
    return _save(Mamba2Config, Mamba2ForCausalLM, kwargs, out_dir, seed)


def save_zamba2(out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """Zamba2 with two shared transformer blocks used at three depths, adapters and rope."""
    from transformers import Zamba2Config, Zamba2ForCausalLM

    kwargs: dict[str, Any] = dict(
        vocab_size=HF_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "mamba", "hybrid"],
        num_attention_heads=4,
        num_key_value_heads=4,
        mamba_d_state=16,
        n_mamba_heads=4,
        mamba_ngroups=1,
        chunk_size=16,
        num_mem_blocks=2,
        use_shared_attention_adapter=True,
        adapter_rank=8,
        use_mem_rope=True,
        **_SPECIAL,
    )
    kwargs.update(overrides)
    return _save(Zamba2Config, Zamba2ForCausalLM, kwargs, out_dir, seed)


def save_lfm2(out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """LFM2: short-conv layers and attention layers with q/k norms."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    kwargs: dict[str, Any] = dict(
        vocab_size=HF_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        full_attn_idxs=[1, 3],
        num_attention_heads=4,
        num_key_value_heads=2,
        conv_L_cache=3,
        block_multiple_of=32,
        **_SPECIAL,
    )
    kwargs.update(overrides)
    return _save(Lfm2Config, Lfm2ForCausalLM, kwargs, out_dir, seed)


def save_jamba(out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """Jamba: Mamba1 layers with inner norms, one attention layer, MoE every other layer."""
    from transformers import JambaConfig, JambaForCausalLM

    kwargs: dict[str, Any] = dict(
        vocab_size=HF_VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_period=4,
        attn_layer_offset=2,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        **_SPECIAL,
    )
    kwargs.update(overrides)
    return _save(JambaConfig, JambaForCausalLM, kwargs, out_dir, seed)
