"""NemotronH (`NemotronHForCausalLM`): pre-norm blocks of one mixer each, Mamba2 / attention / MLP / MoE.

Matches transformers 5.23's modeling_nemotron_h: every block is `h + mixer(norm(h))`; attention
has no positional embedding and no bias (whatever `attention_bias` says); the MLP is
`down(relu2(up(x)))`; the Mamba2 mixer clamps dt to (time_step_min, inf) in prefill; the final norm is
`norm_f`; RMSNorm multiplies by its weight in float32. Checkpoint names may use the published
`backbone.` prefix and per-expert matrices; multi-token-prediction (`mtp.*`) weights are ignored.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.layers.attention import PagedAttention
from himamba.services.worker.layers.linear import Linear
from himamba.services.worker.layers.mamba2 import Mamba2Mixer
from himamba.services.worker.layers.mlp import MLP
from himamba.services.worker.layers.moe import RoutedExperts, SigmoidGroupTopKRouter
from himamba.services.worker.layers.norm import RMSNorm
from himamba.services.worker.models.hf_config import ConfigFields
from himamba.services.worker.models.hybrid_decoder import HybridDecoderLM, StackNames, pool_layout
from himamba.services.worker.models.weight_loading import WeightTarget, load_named_weights
from himamba.services.worker.pools import KVPool, StatePool

# Every spelling of a layer kind found in NemotronH configs -> our kind.
_LAYER_KINDS = MappingProxyType(
    {
        "linear_attention": "mamba",
        "mamba": "mamba",
        "M": "mamba",
        "full_attention": "attention",
        "attention": "attention",
        "*": "attention",
        "mlp": "mlp",
        "-": "mlp",
        "moe": "moe",
        "E": "moe",
    }
)
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")


def _layer_kinds(fields: ConfigFields) -> tuple[str, ...]:
    listed = fields.get("layers_block_type", "layer_types")
    if listed is not None:
        source, names = "layers_block_type", listed
        if not isinstance(names, list):
            raise ValueError(f"NemotronH config.json: field 'layers_block_type' must be a list, got {names!r}")
    else:
        pattern = fields.str("hybrid_override_pattern")
        if pattern is None:
            raise ValueError(
                "NemotronH config.json: field 'layers_block_type' (or 'hybrid_override_pattern') is required"
            )
        source, names = "hybrid_override_pattern", list(pattern)
    unknown = sorted({str(n) for n in names if n not in _LAYER_KINDS})
    if unknown:
        raise ValueError(f"NemotronH config.json: field {source!r} has unknown layer types {unknown}")
    if not names:
        raise ValueError(f"NemotronH config.json: field {source!r} must name at least one layer")
    return tuple(_LAYER_KINDS[n] for n in names)


@dataclass(frozen=True)
class NemotronHConfig:
    """The NemotronH hyper-parameters our implementation uses, parsed from config.json."""

    vocab_size: int
    hidden_size: int
    layer_kinds: tuple[str, ...]  # "mamba" | "attention" | "mlp" | "moe", one per layer
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    mlp_hidden_act: str
    mlp_bias: bool
    ssm_state_size: int
    mamba_num_heads: int
    mamba_head_dim: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    use_conv_bias: bool
    use_bias: bool
    time_step_min: float
    mamba_hidden_act: str
    layer_norm_epsilon: float
    tie_word_embeddings: bool
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    moe_shared_expert_intermediate_size: int
    moe_latent_size: int | None
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> NemotronHConfig:
        """Parse a raw config.json dict, accepting the published and transformers-5 spellings."""
        f = ConfigFields(raw, "NemotronH")
        heads = f.int("num_attention_heads", default=32)
        latent = f.get("moe_latent_size")
        if latent is not None and (isinstance(latent, bool) or not isinstance(latent, int)):
            raise ValueError(
                f"NemotronH config.json: field 'moe_latent_size' must be an integer or null, got {latent!r}"
            )
        return cls(
            vocab_size=f.int("vocab_size"),
            hidden_size=f.int("hidden_size"),
            layer_kinds=_layer_kinds(f),
            num_attention_heads=heads,
            num_key_value_heads=f.int("num_key_value_heads", default=heads),
            head_dim=f.int("head_dim", "attention_head_dim", default=128),
            intermediate_size=f.int("intermediate_size", default=21504),
            mlp_hidden_act=f.str("mlp_hidden_act", default="relu2") or "relu2",
            mlp_bias=f.bool("mlp_bias", default=False),
            ssm_state_size=f.int("ssm_state_size", default=128),
            mamba_num_heads=f.int("mamba_num_heads", default=128),
            mamba_head_dim=f.int("mamba_head_dim", default=64),
            n_groups=f.int("n_groups", "mamba_n_groups", default=8),
            conv_kernel=f.int("conv_kernel", "mamba_d_conv", default=4),
            chunk_size=f.int("chunk_size", "mamba_chunk_size", default=128),
            use_conv_bias=f.bool("use_conv_bias", "mamba_conv_bias", default=True),
            use_bias=f.bool("use_bias", default=False),
            time_step_min=f.float("time_step_min", "mamba_dt_min", default=0.001),
            mamba_hidden_act=f.str("mamba_hidden_act", default="silu") or "silu",
            layer_norm_epsilon=f.float("layer_norm_epsilon", default=1e-5),
            tie_word_embeddings=f.bool("tie_word_embeddings", default=False),
            n_routed_experts=f.int("n_routed_experts", "num_local_experts", default=8),
            num_experts_per_tok=f.int("num_experts_per_tok", default=2),
            moe_intermediate_size=f.int("moe_intermediate_size", default=7688),
            moe_shared_expert_intermediate_size=f.int("moe_shared_expert_intermediate_size", default=7688),
            moe_latent_size=latent,
            n_group=f.int("n_group", default=1),
            topk_group=f.int("topk_group", default=1),
            norm_topk_prob=f.bool("norm_topk_prob", default=True),
            routed_scaling_factor=f.float("routed_scaling_factor", default=1.0),
        )


class NemotronHMoE(nn.Module):
    """Routed relu2 experts (optionally in a latent space) plus one shared relu2 MLP."""

    def __init__(self, cfg: NemotronHConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        expert_dim = cfg.moe_latent_size or cfg.hidden_size
        self.gate = SigmoidGroupTopKRouter(
            cfg.hidden_size,
            cfg.n_routed_experts,
            cfg.num_experts_per_tok,
            cfg.n_group,
            cfg.topk_group,
            cfg.norm_topk_prob,
            cfg.routed_scaling_factor,
            device,
            dtype,
        )
        self.experts = RoutedExperts(
            cfg.n_routed_experts, expert_dim, cfg.moe_intermediate_size, cfg.mlp_hidden_act, False, device, dtype
        )
        self.shared_experts = MLP(
            cfg.hidden_size, cfg.moe_shared_expert_intermediate_size, cfg.mlp_hidden_act, cfg.mlp_bias, device, dtype
        )
        self.fc1_latent_proj: Linear | None = None
        self.fc2_latent_proj: Linear | None = None
        if cfg.moe_latent_size is not None:
            self.fc1_latent_proj = Linear(cfg.hidden_size, cfg.moe_latent_size, cfg.mlp_bias, device, dtype)
            self.fc2_latent_proj = Linear(cfg.moe_latent_size, cfg.hidden_size, cfg.mlp_bias, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = self.gate(x)
        h = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        h = self.experts(h, routing)
        if self.fc2_latent_proj is not None:
            h = self.fc2_latent_proj(h)
        return h + self.shared_experts(x)


class NemotronHBlock(nn.Module):
    """`h + mixer(norm(h))`; `pool_index` is this layer's index among the KV (attention) or state
    (mamba) layers of the pools."""

    def __init__(self, kind: str, mixer: nn.Module, norm: RMSNorm, pool_index: int) -> None:
        super().__init__()
        self.kind = kind
        self.pool_index = pool_index
        self.norm = norm
        self.mixer = mixer

    def recurrent_mixer(self) -> nn.Module | None:
        return self.mixer if self.kind == "mamba" else None

    def step(self, h: torch.Tensor, batch: ForwardBatch, kv: KVPool, state: StatePool) -> torch.Tensor:
        x = self.norm(h)
        if self.kind == "mamba":
            out = self.mixer(x, *state.layer(self.pool_index, batch))
        elif self.kind == "attention":
            out = self.mixer(x, batch, kv.k[self.pool_index], kv.v[self.pool_index])
        else:
            out = self.mixer(x)
        return h.add_(out)  # h is the forward's own tensor (the embedding lookup's output)


class NemotronHForCausalLM(HybridDecoderLM):
    """NemotronH as a `HybridModel`. Parameters are allocated uninitialised; call `load_weights`."""

    supports_tensor_parallel = True
    config_type = NemotronHConfig
    stack_names = StackNames(embed="embeddings", final_norm="norm_f")
    ties_head_at_build = False  # settled by the checkpoint, in load_weights
    skipped_prefixes = ("mtp.",)  # multi-token-prediction heads
    skipped_suffixes = ()  # no rope, so no rotary buffers

    def __init__(self, cfg: NemotronHConfig, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__(cfg, dtype)
        device = torch.device(device)
        h = cfg.hidden_size
        eps = cfg.layer_norm_epsilon
        layers: list[NemotronHBlock] = []
        pools = pool_layout(cfg.layer_kinds, "mamba")
        for kind, pool in zip(cfg.layer_kinds, pools.indices, strict=True):
            mixer: nn.Module
            if kind == "mamba":
                mixer = Mamba2Mixer(
                    hidden_size=h,
                    num_heads=cfg.mamba_num_heads,
                    head_dim=cfg.mamba_head_dim,
                    state_size=cfg.ssm_state_size,
                    n_groups=cfg.n_groups,
                    conv_kernel=cfg.conv_kernel,
                    chunk_size=cfg.chunk_size,
                    norm_eps=eps,
                    device=device,
                    dtype=dtype,
                    # transformers' NemotronH mixer clamps at time_step_min, not time_step_limit.
                    dt_limit=(cfg.time_step_min, math.inf),
                    conv_bias=cfg.use_conv_bias,
                    proj_bias=cfg.use_bias,
                    activation=cfg.mamba_hidden_act,
                )
            elif kind == "attention":
                mixer = PagedAttention(
                    h,
                    cfg.num_attention_heads,
                    cfg.num_key_value_heads,
                    cfg.head_dim,
                    cfg.head_dim**-0.5,
                    False,
                    device,
                    dtype,
                )
            elif kind == "mlp":
                mixer = MLP(h, cfg.intermediate_size, cfg.mlp_hidden_act, cfg.mlp_bias, device, dtype)
            else:
                mixer = NemotronHMoE(cfg, device, dtype)
            norm = RMSNorm(h, eps, device, dtype, multiply_in_float32=True)
            layers.append(NemotronHBlock(kind, mixer, norm, pool))
        self.attach_stack(layers, RMSNorm(h, eps, device, dtype, multiply_in_float32=True), device, pools.sizes)

    def rename_weight(self, hf_name: str) -> WeightTarget:
        if hf_name.startswith("backbone."):
            hf_name = "model." + hf_name[len("backbone.") :]
        per_expert = _PER_EXPERT.match(hf_name)
        if per_expert:
            return WeightTarget(f"{per_expert.group(1)}.{per_expert.group(3)}", int(per_expert.group(2)))
        return WeightTarget(hf_name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; raises ValueError naming missing or unexpected weights.

        transformers never ties NemotronH's head (it saves and uses `lm_head.weight` even with
        tie_word_embeddings), so a present head is used; a tied config without one reuses the
        embedding table.
        """
        optional = frozenset({"lm_head.weight"}) if self.config.tie_word_embeddings else frozenset()
        loaded = load_named_weights(self, weights, self.resolve_weight, optional)
        if "lm_head.weight" not in loaded:
            self.lm_head.tie_to(self.stack.embedding())
