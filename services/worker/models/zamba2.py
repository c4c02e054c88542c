"""Zamba2 (`Zamba2ForCausalLM`): Mamba2 layers, some preceded by a shared transformer block.

Matches transformers 5.23's modeling_zamba2. A "hybrid" layer runs one of `num_mem_blocks` shared
transformer blocks (the same weights at several depths, assigned round-robin by hybrid-use index)
on concat(h, embeddings): RMSNorm over 2*hidden, attention with head_dim `attention_head_dim` (by
default 2*hidden/heads) and softmax scale (head_dim/2)^-0.5 (rope over the whole head when
`use_mem_rope`), then pre_ff_layernorm and a fused gate/up MLP;
per-use LoRA adapters (`*_adapter_list.<use>`) add to q/k/v (with `use_shared_attention_adapter`)
and always to the MLP's gate_up. The block's output goes through the layer's own `linear` and is
added to the Mamba input only: `h += mamba(input_layernorm(h + linear(block(h, emb))))`. Each use
owns one KV layer of the pool. The mixer clamps dt at `time_step_min` in prefill, and its norm eps is 1e-5.
Checkpoints store each shared block under the first layer that uses it. As in transformers, the
blocks are shared only when `tie_word_embeddings` is true; otherwise each hybrid layer has its own.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.layers.activation import activation_fn
from himamba.services.worker.layers.linear import Linear
from himamba.services.worker.layers.mamba2 import Mamba2Mixer
from himamba.services.worker.layers.norm import RMSNorm
from himamba.services.worker.layers.partial_rotary import PartialRotaryEmbedding
from himamba.services.worker.layers.projected_attention import ProjectedAttention
from himamba.services.worker.models.hf_config import ConfigFields
from himamba.services.worker.models.hybrid_decoder import HybridDecoderLM, PoolSizes, StackNames
from himamba.services.worker.models.rope_params import RopeSettings, rope_settings
from himamba.services.worker.models.weight_loading import WeightTarget
from himamba.services.worker.pools import KVPool, KVSpec, StatePool

_KINDS = MappingProxyType({"mamba": "mamba", "linear_attention": "mamba", "hybrid": "hybrid"})
_SHARED = re.compile(r"^model\.layers\.(\d+)\.shared_transformer\.(.+)$")
# transformers hard-codes the mixer's gated-norm epsilon.
_MIXER_NORM_EPS = 1e-5


@dataclass(frozen=True)
class Zamba2Config:
    """The Zamba2 hyper-parameters our implementation uses, parsed from config.json."""

    vocab_size: int
    hidden_size: int
    layer_kinds: tuple[str, ...]  # "mamba" | "hybrid"
    intermediate_size: int
    hidden_act: str
    add_bias_linear: bool
    num_attention_heads: int
    attention_head_dim: int
    num_key_value_heads: int
    num_mem_blocks: int
    use_shared_attention_adapter: bool
    adapter_rank: int
    rope: RopeSettings | None  # None: no positional embedding (use_mem_rope false)
    rms_norm_eps: float
    tie_word_embeddings: bool
    mamba_n_heads: int
    mamba_head_dim: int
    mamba_d_state: int
    mamba_ngroups: int
    mamba_d_conv: int
    chunk_size: int
    time_step_min: float

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> Zamba2Config:
        """Parse a raw config.json dict (new "linear_attention" or legacy "mamba" layer names)."""
        f = ConfigFields(raw, "Zamba2")
        hidden = f.int("hidden_size")
        num_layers = f.int("num_hidden_layers", default=54)
        listed = f.get("layers_block_type", "layer_types")
        if not isinstance(listed, list) or any(k not in _KINDS for k in listed) or len(listed) != num_layers:
            raise ValueError(
                f"Zamba2 config.json: field 'layers_block_type' must list {num_layers} mamba/hybrid layers, "
                f"got {listed!r}"
            )
        heads = f.int("num_attention_heads", default=32)
        # transformers derives 2 * hidden / heads but honours a config that sets it ("head_dim" is its alias).
        head_dim = f.int("attention_head_dim", "head_dim", default=0)
        if head_dim == 0 and (2 * hidden) % heads != 0:
            raise ValueError(f"Zamba2 config.json: num_attention_heads ({heads}) must divide 2 * hidden_size")
        if head_dim < 0:
            raise ValueError(f"Zamba2 config.json: field 'attention_head_dim' must be >= 1, got {head_dim}")
        mamba_heads = f.int("n_mamba_heads", default=8)
        width = f.int("mamba_expand", default=2) * hidden
        if width % mamba_heads != 0:
            raise ValueError(f"Zamba2 config.json: field 'n_mamba_heads' ({mamba_heads}) must divide {width}")
        blocks = f.int("num_mem_blocks", default=1)
        if blocks < 1:
            raise ValueError(f"Zamba2 config.json: field 'num_mem_blocks' must be >= 1, got {blocks}")
        kv_heads = f.int("num_key_value_heads", default=heads)
        adapters = f.bool("use_shared_attention_adapter", default=False)
        if adapters and kv_heads != heads:
            # The k/v adapters are as wide as q (transformers fails on this combination too).
            raise ValueError(
                "Zamba2 config.json: field 'use_shared_attention_adapter' needs num_key_value_heads == "
                f"num_attention_heads, got {kv_heads} and {heads}"
            )
        return cls(
            vocab_size=f.int("vocab_size"),
            hidden_size=hidden,
            layer_kinds=tuple(_KINDS[k] for k in listed),
            intermediate_size=f.int("intermediate_size", default=4 * hidden),
            hidden_act=f.str("hidden_act", default="gelu") or "gelu",
            add_bias_linear=f.bool("add_bias_linear", default=False),
            num_attention_heads=heads,
            attention_head_dim=head_dim or 2 * hidden // heads,
            num_key_value_heads=kv_heads,
            num_mem_blocks=blocks,
            use_shared_attention_adapter=adapters,
            adapter_rank=f.int("adapter_rank", default=128),
            rope=rope_settings(f, default_theta=10000.0, reads_partial=False) if f.bool("use_mem_rope", default=False) else None,
            rms_norm_eps=f.float("rms_norm_eps", default=1e-5),
            tie_word_embeddings=f.bool("tie_word_embeddings", default=True),
            mamba_n_heads=mamba_heads,
            mamba_head_dim=width // mamba_heads,
            mamba_d_state=f.int("mamba_d_state", default=64),
            mamba_ngroups=f.int("mamba_ngroups", default=1),
            mamba_d_conv=f.int("mamba_d_conv", default=4),
            chunk_size=f.int("chunk_size", default=256),
            time_step_min=f.float("time_step_min", default=0.001),
        )


def _adapter(in_features: int, rank: int, out_features: int, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A LoRA pair named like HF's nn.Sequential: `.0` down, `.1` up."""
    return nn.Sequential(
        Linear(in_features, rank, False, device, dtype), Linear(rank, out_features, False, device, dtype)
    )


class Zamba2Attention(ProjectedAttention):
    """Attention over concat(h, embeddings) with per-use q/k/v adapters."""

    def __init__(self, cfg: Zamba2Config, uses: list[int], device: torch.device, dtype: torch.dtype) -> None:
        d_in, hd = 2 * cfg.hidden_size, cfg.attention_head_dim
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        super().__init__(d_in, cfg.hidden_size, heads, kv_heads, hd, False, device, dtype)
        self.adapted = cfg.use_shared_attention_adapter
        if self.adapted:
            rank = cfg.adapter_rank
            for name in ("q", "k", "v"):
                adapters = nn.ModuleDict({str(u): _adapter(d_in, rank, d_in, device, dtype) for u in uses})
                self.add_module(f"linear_{name}_adapter_list", adapters)
        self.rotary: PartialRotaryEmbedding | None = cfg.rope.rotary(hd, device) if cfg.rope is not None else None

    def forward(
        self, x: torch.Tensor, use: int, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        q, k, v = self.project_qkv(x)
        if self.adapted:
            key = str(use)
            q = q + self.linear_q_adapter_list[key](x)
            k = k + self.linear_k_adapter_list[key](x)
            v = v + self.linear_v_adapter_list[key](x)
        q, k, v = self.split_heads(q, k, v)
        if self.rotary is not None:
            q, k = self.rotary(q, k, batch.positions)
        # transformers scales by (head_dim / 2) ** -0.5: the input is two hidden states side by side.
        return self.o_proj(self.attend(q, k, v, batch, k_cache, v_cache, (self.head_dim / 2) ** -0.5))


class Zamba2MLP(nn.Module):
    """`down_proj(act(g) * u)` with [g | u] = gate_up_proj(x) + the use's adapter(x)."""

    def __init__(self, cfg: Zamba2Config, uses: list[int], device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        h, inter = cfg.hidden_size, cfg.intermediate_size
        self.intermediate_size = inter
        self.act = activation_fn(cfg.hidden_act)
        self.gate_up_proj = Linear(h, 2 * inter, cfg.add_bias_linear, device, dtype)
        self.down_proj = Linear(inter, h, cfg.add_bias_linear, device, dtype)
        self.gate_up_proj_adapter_list = nn.ModuleDict(
            {str(u): _adapter(h, cfg.adapter_rank, 2 * inter, device, dtype) for u in uses}
        )

    def forward(self, x: torch.Tensor, use: int) -> torch.Tensor:
        gate_up = self.gate_up_proj(x) + self.gate_up_proj_adapter_list[str(use)](x)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Zamba2SharedBlock(nn.Module):
    """One shared transformer block (HF `shared_transformer`), run at each of its `uses`."""

    def __init__(self, cfg: Zamba2Config, uses: list[int], device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(2 * cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.self_attn = Zamba2Attention(cfg, uses, device, dtype)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.feed_forward = Zamba2MLP(cfg, uses, device, dtype)

    def forward(
        self,
        h: torch.Tensor,
        embeddings: torch.Tensor,
        use: int,
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        x = self.input_layernorm(torch.cat((h, embeddings), dim=-1))
        x = self.self_attn(x, use, batch, k_cache, v_cache)
        return self.feed_forward(self.pre_ff_layernorm(x), use)


class Zamba2MambaDecoder(nn.Module):
    """`h + mamba(input_layernorm(h + extra))` (HF `Zamba2MambaDecoderLayer`)."""

    def __init__(self, cfg: Zamba2Config, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.mamba = Mamba2Mixer(
            hidden_size=cfg.hidden_size,
            num_heads=cfg.mamba_n_heads,
            head_dim=cfg.mamba_head_dim,
            state_size=cfg.mamba_d_state,
            n_groups=cfg.mamba_ngroups,
            conv_kernel=cfg.mamba_d_conv,
            chunk_size=cfg.chunk_size,
            norm_eps=_MIXER_NORM_EPS,
            device=device,
            dtype=dtype,
            dt_limit=(cfg.time_step_min, float("inf")),
            conv_bias=True,
            proj_bias=cfg.add_bias_linear,
        )

    def forward(
        self, h: torch.Tensor, extra: torch.Tensor | None, batch: ForwardBatch, state: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        x = h if extra is None else h + extra
        return h + self.mamba(self.input_layernorm(x), batch, state)

    def recurrent_mixer(self) -> Mamba2Mixer:
        return self.mamba


class Zamba2HybridLayer(nn.Module):
    """A shared block's use (by index into `model.blocks`), its own `linear`, then its Mamba decoder."""

    def __init__(self, cfg: Zamba2Config, block: int, use: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.block = block
        self.use = use
        self.linear = Linear(cfg.hidden_size, cfg.hidden_size, False, device, dtype)
        self.mamba_decoder = Zamba2MambaDecoder(cfg, device, dtype)

    def recurrent_mixer(self) -> Mamba2Mixer:
        return self.mamba_decoder.mamba


class Zamba2ForCausalLM(HybridDecoderLM):
    """Zamba2 as a `HybridModel`. Parameters are allocated uninitialised; call `load_weights`."""

    config_type = Zamba2Config
    stack_names = StackNames(embed="embed_tokens", final_norm="final_layernorm")

    def __init__(self, cfg: Zamba2Config, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__(cfg, dtype)
        device = torch.device(device)
        hybrid = [i for i, kind in enumerate(cfg.layer_kinds) if kind == "hybrid"]
        mem = cfg.num_mem_blocks
        # transformers ties the shared blocks only together with the embeddings: untied, every
        # hybrid layer has its own block (holding the adapters of every use of its would-be block).
        shared = cfg.tie_word_embeddings
        owners = range(min(mem, len(hybrid))) if shared else range(len(hybrid))
        blocks = [
            Zamba2SharedBlock(cfg, [u for u in range(len(hybrid)) if u % mem == b % mem], device, dtype) for b in owners
        ]
        layers: list[nn.Module] = []
        # Checkpoint layer index of a hybrid layer -> the block it runs.
        self._block_of_layer: dict[int, int] = {}
        for i, kind in enumerate(cfg.layer_kinds):
            if kind == "hybrid":
                use = hybrid.index(i)
                block = use % mem if shared else use
                self._block_of_layer[i] = block
                layers.append(Zamba2HybridLayer(cfg, block, use, device, dtype))
            else:
                layers.append(Zamba2MambaDecoder(cfg, device, dtype))
        self.attach_stack(
            layers,
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype),
            device,
            PoolSizes(attention=len(hybrid), recurrent=len(cfg.layer_kinds)),
            before_layers={"blocks": nn.ModuleList(blocks)},
        )

    def kv_spec(self) -> KVSpec:
        """KV pool shape: one entry per use of a shared block (hybrid layer), in model order."""
        cfg = self.config
        return KVSpec(self.num_attention_layers, cfg.num_key_value_heads, cfg.attention_head_dim, self.dtype)

    def run_layers(self, h: torch.Tensor, batch: ForwardBatch, kv: KVPool, state: StatePool) -> torch.Tensor:
        embeddings = h
        for i, layer in enumerate(self.stack.layers):
            if isinstance(layer, Zamba2HybridLayer):
                block = self.stack.blocks[layer.block]
                extra = layer.linear(block(h, embeddings, layer.use, batch, kv.k[layer.use], kv.v[layer.use]))
                h = layer.mamba_decoder(h, extra, *state.layer(i, batch))
            else:
                h = layer(h, None, *state.layer(i, batch))
        return h

    def rename_weight(self, hf_name: str) -> WeightTarget:
        shared = _SHARED.match(hf_name)
        if shared is not None and int(shared.group(1)) in self._block_of_layer:
            return WeightTarget(f"model.blocks.{self._block_of_layer[int(shared.group(1))]}.{shared.group(2)}")
        return WeightTarget(hf_name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; a shared block may appear under any layer that uses it (transformers
        saves it once, under the first). Raises ValueError naming missing or unexpected weights."""
        super().load_weights(weights)
