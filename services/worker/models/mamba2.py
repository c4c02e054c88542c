"""Mamba2 (`Mamba2ForCausalLM`): a stack of pre-norm Mamba2 blocks and no attention at all.

Matches transformers 5.23's modeling_mamba2: each block is `h + mixer(norm(h))` with the standard
Mamba2 mixer (grouped gated norm, `time_step_limit`); the final norm is `norm_f`; with
`residual_in_fp32` (the default) the residual stream is kept in float32 below float32 models.
Checkpoints use the `backbone.` prefix (older ones spell the table `backbone.embedding`). The KV
pool of this model has no layers: the worker keeps pages for bookkeeping only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.layers.embedding import LMHead, VocabEmbedding
from himamba.services.worker.layers.mamba2 import Mamba2Mixer
from himamba.services.worker.layers.norm import RMSNorm
from himamba.services.worker.models.batch_checks import check_batch
from himamba.services.worker.models.hf_config import ConfigFields
from himamba.services.worker.models.weight_loading import WeightTarget, load_named_weights
from himamba.services.worker.pools import KVPool, KVSpec, StatePool, StateSpec


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
    """`h + mixer(norm(h))` (HF names)."""

    def __init__(self, cfg: Mamba2Config, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
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


class _Backbone(nn.Module):
    def __init__(self, embeddings: VocabEmbedding, layers: list[Mamba2Block], norm_f: RMSNorm) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.layers = nn.ModuleList(layers)
        self.norm_f = norm_f


class Mamba2ForCausalLM(nn.Module):
    """Mamba2 as a `HybridModel` (with an empty KV spec). Parameters are allocated uninitialised;
    call `load_weights`."""

    def __init__(self, cfg: Mamba2Config, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = cfg
        self.dtype = dtype
        self.vocab_size = cfg.vocab_size
        embed = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, device, dtype)
        layers = [Mamba2Block(cfg, device, dtype) for _ in range(cfg.num_hidden_layers)]
        self.backbone = _Backbone(embed, layers, RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, device, dtype))
        self.lm_head = LMHead(
            cfg.vocab_size, cfg.hidden_size, device, dtype, tied_to=embed if cfg.tie_word_embeddings else None
        )

    @classmethod
    def from_hf_config(
        cls, raw: Mapping[str, Any], device: torch.device | str, dtype: torch.dtype
    ) -> Mamba2ForCausalLM:
        """Build the (uninitialised) model from a raw config.json dict."""
        return cls(Mamba2Config.from_hf(raw), device, dtype)

    def kv_spec(self) -> KVSpec:
        """No attention layer: a KV spec with zero layers (pages are bookkeeping only)."""
        return KVSpec(0, 1, 1, self.dtype)

    def state_spec(self) -> StateSpec:
        """State pool shape: "conv" and "ssm" per layer."""
        return StateSpec(tuple(layer.mixer.state_components() for layer in self.backbone.layers))

    def forward(self, batch: ForwardBatch, kv: KVPool, state: StatePool) -> torch.Tensor:
        """Logits [B, vocab] (float32) of each sequence's last new token; updates the state pool."""
        check_batch(batch, kv, state, 0, self.config.num_hidden_layers)
        with torch.inference_mode():
            h = self.backbone.embeddings(batch.input_ids)
            if self.config.residual_in_fp32:
                h = h.float()
            for i, layer in enumerate(self.backbone.layers):
                x = layer.norm(h.to(self.dtype))
                h = h + layer.mixer(x, batch, state.tensors[i])
            last = h.index_select(0, batch.last_token_index.to(h.device))
            return self.lm_head(self.backbone.norm_f(last).to(self.dtype))

    def _resolve(self, hf_name: str) -> WeightTarget | None:
        if hf_name == "lm_head.weight" and self.lm_head.is_tied:
            return None
        if hf_name == "backbone.embedding.weight":
            hf_name = "backbone.embeddings.weight"
        return WeightTarget(hf_name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; raises ValueError naming missing or unexpected weights."""
        load_named_weights(self, weights, self._resolve)
