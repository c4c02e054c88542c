"""transformers as the reference: tiny random checkpoints saved by `save_pretrained`, and its outputs.

Every parameter is perturbed away from its init constant before saving (norm weights, D, biases,
router correction bias), so a swapped or skipped parameter cannot hide behind a value of 1 or 0.
"""

from __future__ import annotations

from pathlib import Path
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


def save_nemotron_h(out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """A tiny NemotronH with every layer kind (MoE with latent projections and group routing)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    kwargs: dict[str, Any] = dict(
        vocab_size=HF_VOCAB,
        hidden_size=64,
        layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        mamba_num_heads=8,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=2,
        chunk_size=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48,
        moe_latent_size=32,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        eos_token_id=0,
        bos_token_id=0,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(NemotronHConfig(**kwargs))
    _perturb(model, seed)
    model.save_pretrained(out_dir)
    return Path(out_dir)


def save_granite_hybrid(out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """A tiny dense Granite-4.0-H with rope, GQA and non-trivial multipliers."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    kwargs: dict[str, Any] = dict(
        vocab_size=HF_VOCAB,
        hidden_size=64,
        num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        shared_intermediate_size=96,
        intermediate_size=32,
        num_local_experts=0,
        mamba_n_heads=8,
        mamba_d_state=16,
        mamba_n_groups=2,
        mamba_chunk_size=16,
        position_embedding_type="rope",
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.0625,
        logits_scaling=4.0,
        eos_token_id=0,
        bos_token_id=0,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(**kwargs))
    _perturb(model, seed)
    model.save_pretrained(out_dir)
    return Path(out_dir)


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
