"""Mamba2 (`Mamba2ForCausalLM`): a stack of pre-norm Mamba2 blocks and no attention at all.

Matches transformers 5.23's modeling_mamba2: each block is `h + mixer(norm(h))` with the standard
Mamba2 mixer (grouped gated norm, `time_step_limit`); the final norm is `norm_f`; with
`residual_in_fp32` (the default) the residual stream is kept in float32 below float32 models.
Checkpoints use the `backbone.` prefix (older ones spell the table `backbone.embedding`). The KV
pool of this model has no layers: the worker keeps pages for bookkeeping only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.layers.mamba2 import Mamba2Mixer
from himamba.services.worker.layers.norm import RMSNorm
from himamba.services.worker.models.hf_config import ConfigFields
from himamba.services.worker.models.hybrid_decoder import HybridDecoderLM, PoolSizes, StackNames
from himamba.services.worker.models.weight_loading import WeightTarget
from himamba.services.worker.pools import KVPool, KVSpec, StatePool


@dataclass(frozen=True)
class Mamba2Config:
    """The Mamba2 hyper-parameters our implementation uses, parsed from config.json."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    use_bias: bool
    use_conv_bias: bool
    hidden_act: str
    layer_norm_epsilon: float
    time_step_limit: tuple[float, float]
    residual_in_fp32: bool
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> Mamba2Config:
        """Parse a raw config.json dict."""
        f = ConfigFields(raw, "Mamba2")
        hidden = f.int("hidden_size")
        heads = f.int("num_heads", default=128)
        head_dim = f.int("head_dim", default=64)
        expand = f.int("expand", default=2)
        if heads * head_dim != expand * hidden:
            raise ValueError(
                f"Mamba2 config.json: field 'num_heads' ({heads}) times head_dim ({head_dim}) must equal "
                f"expand * hidden_size ({expand * hidden})"
            )
        return cls(
            vocab_size=f.int("vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=f.int("num_hidden_layers", default=64),
            num_heads=heads,
            head_dim=head_dim,
            state_size=f.int("state_size", default=128),
            n_groups=f.int("n_groups", default=8),
            conv_kernel=f.int("conv_kernel", default=4),
            chunk_size=f.int("chunk_size", default=256),
            use_bias=f.bool("use_bias", default=False),
            use_conv_bias=f.bool("use_conv_bias", default=True),
            hidden_act=f.str("hidden_act", default="silu") or "silu",
            layer_norm_epsilon=f.float("layer_norm_epsilon", default=1e-5),
            time_step_limit=f.float_pair("time_step_limit", default=(0.0, float("inf"))),
            residual_in_fp32=f.bool("residual_in_fp32", default=True),
            tie_word_embeddings=f.bool("tie_word_embeddings", default=False),
        )


class Mamba2Block(nn.Module):
    """`h + mixer(norm(h))` (HF names); the norm's input is cast to the model's dtype, since the
    residual stream `h` may be float32."""

    def __init__(self, cfg: Mamba2Config, pool_index: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.pool_index = pool_index
        self.dtype = dtype
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, device, dtype)
        self.mixer = Mamba2Mixer(
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_heads,
            head_dim=cfg.head_dim,
            state_size=cfg.state_size,
            n_groups=cfg.n_groups,
            conv_kernel=cfg.conv_kernel,
            chunk_size=cfg.chunk_size,
            norm_eps=cfg.layer_norm_epsilon,
            device=device,
            dtype=dtype,
            dt_limit=cfg.time_step_limit,
            conv_bias=cfg.use_conv_bias,
            proj_bias=cfg.use_bias,
            activation=cfg.hidden_act,
        )

    def recurrent_mixer(self) -> Mamba2Mixer:
        return self.mixer

    def step(self, h: torch.Tensor, batch: ForwardBatch, kv: KVPool, state: StatePool) -> torch.Tensor:
        return h + self.mixer(self.norm(h.to(self.dtype)), *state.layer(self.pool_index, batch))


class Mamba2ForCausalLM(HybridDecoderLM):
    """Mamba2 as a `HybridModel` (with an empty KV spec). Parameters are allocated uninitialised;
    call `load_weights`."""

    supports_tensor_parallel = True
    config_type = Mamba2Config
    stack_name = "backbone"
    stack_names = StackNames(embed="embeddings", final_norm="norm_f")
    skipped_suffixes = ()  # no rope, so no rotary buffers

    def __init__(self, cfg: Mamba2Config, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__(cfg, dtype)
        device = torch.device(device)
        n = cfg.num_hidden_layers
        self.attach_stack(
            [Mamba2Block(cfg, i, device, dtype) for i in range(n)],
            RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, device, dtype),
            device,
            PoolSizes(attention=0, recurrent=n),
        )

    def kv_spec(self) -> KVSpec:
        """No attention layer: a KV spec with zero layers (pages are bookkeeping only)."""
        return KVSpec(0, 1, 1, self.dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = super().embed(input_ids)
        return h.float() if self.config.residual_in_fp32 else h

    def logits(self, last: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.stack.final_norm()(last).to(self.dtype))

    def rename_weight(self, hf_name: str) -> WeightTarget:
        if hf_name == "backbone.embedding.weight":
            hf_name = "backbone.embeddings.weight"
        return WeightTarget(hf_name)
