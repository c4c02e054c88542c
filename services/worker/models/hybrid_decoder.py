"""The decoder body every hybrid family shares: the stack, the forward over a ForwardBatch, the pool
layouts and checkpoint-name resolution.

A family file keeps what is special about it (its config, its layers and mixers, its weight
renames) and inherits the rest: embed, run each layer's `step` (recurrent mixers read and write
their state-pool layer, attention mixers their paged KV layer), final norm, logits of each
sequence's last new token. Attribute names stay HF's, so checkpoint names load unchanged.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar, NamedTuple, Protocol, Self

import torch
from torch import nn

from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.layers.embedding import LMHead, VocabEmbedding
from himamba.services.worker.models.batch_checks import check_batch
from himamba.services.worker.models.expert_weights import merge_expert_weights, stacked_row
from himamba.services.worker.models.weight_loading import WeightTarget, load_named_weights
from himamba.services.worker.pools import KVPool, KVSpec, StateComponent, StatePool, StateSpec
from himamba.services.worker.step_threads import threads_for
from himamba.services.worker.tensor_parallel import group


class RecurrentMixer(Protocol):
    """A mixer that owns one layer of the state pool."""

    def state_components(self) -> tuple[StateComponent, ...]: ...


class DecoderLayer(Protocol):
    """What the shared forward needs of a layer."""

    def recurrent_mixer(self) -> RecurrentMixer | None: ...

    def step(self, h: torch.Tensor, batch: ForwardBatch, kv: KVPool, state: StatePool) -> torch.Tensor: ...


class FamilyConfig(Protocol):
    """What the shared model needs of a family's parsed config."""

    vocab_size: int
    hidden_size: int
    tie_word_embeddings: bool


class PoolSizes(NamedTuple):
    """How many layers the KV pool (attention) and the state pool (recurrent) have."""

    attention: int
    recurrent: int


class PoolLayout(NamedTuple):
    """Each layer's index among the layers of its kind (its pool entry), and the pool sizes."""

    indices: tuple[int, ...]
    sizes: PoolSizes


def pool_layout(kinds: Sequence[str], recurrent: str) -> PoolLayout:
    """Pool entries of layers of kinds `kinds`: "attention" ones use the KV pool, `recurrent` ones the state pool."""
    seen: Counter[str] = Counter()
    indices = []
    for kind in kinds:
        indices.append(seen[kind])
        seen[kind] += 1
    return PoolLayout(tuple(indices), PoolSizes(seen["attention"], seen[recurrent]))


class LayerNames(NamedTuple):
    """HF attribute names of a mixer-then-feed-forward layer's parts."""

    mixer_norm: str
    recurrent: str  # the recurrent mixer; the attention mixer is always `self_attn`
    ffn_norm: str
    ffn: str


class MixerLayer(nn.Module):
    """A layer whose mixer is recurrent or attention (exactly one of them is set), then a feed-forward:
    `h += mixer(mixer_norm(h))`, `h += ffn(ffn_norm(h))`.

    Subclasses register the parts under `names` (and `self_attn`); `pool_index` is the layer's
    entry in the pool of its mixer's kind.
    """

    names: ClassVar[LayerNames]

    def __init__(self, pool_index: int) -> None:
        super().__init__()
        self.pool_index = pool_index

    def recurrent_mixer(self) -> nn.Module | None:
        return getattr(self, self.names.recurrent)

    def mix(self, x: torch.Tensor, batch: ForwardBatch, kv: KVPool, state: StatePool) -> torch.Tensor:
        """The mixer's output for normed input `x`, reading and writing this layer's pool entry."""
        recurrent = self.recurrent_mixer()
        if recurrent is not None:
            return recurrent(x, *state.layer(self.pool_index, batch))
        return self.self_attn(x, batch, kv.k[self.pool_index], kv.v[self.pool_index])

    def step(self, h: torch.Tensor, batch: ForwardBatch, kv: KVPool, state: StatePool) -> torch.Tensor:
        """The residual stream after this layer."""
        names = self.names
        h = h + self.mix(getattr(self, names.mixer_norm)(h), batch, kv, state)
        return h + getattr(self, names.ffn)(getattr(self, names.ffn_norm)(h))


class StackNames(NamedTuple):
    """HF attribute names of a stack's embedding table and final norm."""

    embed: str
    final_norm: str


class DecoderStack(nn.Module):
    """HF's `model` (or `backbone`): embedding table, `layers`, final norm, under the family's names.

    `before_layers` are registered between the table and the layers (Zamba2's shared blocks).
    """

    def __init__(
        self,
        names: StackNames,
        embed: VocabEmbedding,
        layers: Sequence[nn.Module],
        final_norm: nn.Module,
        before_layers: Mapping[str, nn.Module] = MappingProxyType({}),
    ) -> None:
        super().__init__()
        self.names = names
        self.add_module(names.embed, embed)
        for name, module in before_layers.items():
            self.add_module(name, module)
        self.layers = nn.ModuleList(layers)
        self.add_module(names.final_norm, final_norm)

    def embedding(self) -> VocabEmbedding:
        return getattr(self, self.names.embed)

    def final_norm(self) -> nn.Module:
        return getattr(self, self.names.final_norm)


class HybridDecoderLM(nn.Module):
    """A family's `*ForCausalLM` as a `HybridModel`. Parameters are allocated uninitialised; call `load_weights`.

    A subclass builds its layers (each a `DecoderLayer`) and calls `attach_stack`; it may override
    `embed`, `run_layers` and `logits` (the forward's three stages), `kv_spec`, and `rename_weight`
    (checkpoint names).
    """

    config_type: ClassVar[Any]  # has `from_hf(raw) -> config`
    stack_name: ClassVar[str] = "model"
    stack_names: ClassVar[StackNames]
    # Whether the head reads the embedding table when the config says `tie_word_embeddings`.
    ties_head_at_build: ClassVar[bool] = True
    # Checkpoint entries that are not parameters: by default the rotary buffers transformers may save.
    skipped_prefixes: ClassVar[tuple[str, ...]] = ()
    skipped_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)
    # MoE checkpoints may store experts one by one or stacked (see expert_weights): both load.
    merges_expert_weights: ClassVar[bool] = False
    # Whether every layer of the family shards itself under tensor parallelism (tensor_parallel.py).
    supports_tensor_parallel: ClassVar[bool] = False

    def __init__(self, cfg: FamilyConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config: Any = cfg
        self.dtype = dtype
        self.vocab_size = cfg.vocab_size
        self.num_attention_layers = 0
        self.num_recurrent_layers = 0

    @classmethod
    def from_hf_config(cls, raw: Mapping[str, Any], device: torch.device | str, dtype: torch.dtype) -> Self:
        """Build the (uninitialised) model from a raw config.json dict."""
        return cls(cls.config_type.from_hf(raw), device, dtype)  # type: ignore[call-arg]  # subclass signature

    def attach_stack(
        self,
        layers: Sequence[nn.Module],
        final_norm: nn.Module,
        device: torch.device,
        pools: PoolSizes,
        *,
        embedding_multiplier: float = 1.0,
        logits_divisor: float = 1.0,
        before_layers: Mapping[str, nn.Module] = MappingProxyType({}),
    ) -> None:
        """Register the stack (embedding table, layers, final norm) and the head."""
        cfg = self.config
        embed = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, device, self.dtype, multiplier=embedding_multiplier)
        self.add_module(self.stack_name, DecoderStack(self.stack_names, embed, layers, final_norm, before_layers))
        tied = self.ties_head_at_build and cfg.tie_word_embeddings
        self.lm_head = LMHead(
            cfg.vocab_size,
            cfg.hidden_size,
            device,
            self.dtype,
            tied_to=embed if tied else None,
            logits_divisor=logits_divisor,
        )
        self.num_attention_layers, self.num_recurrent_layers = pools

    @property
    def stack(self) -> DecoderStack:
        return getattr(self, self.stack_name)

    def kv_spec(self) -> KVSpec:
        """KV pool shape: one entry per attention layer, in model order (this rank's KV heads: its share,
        or the one head it reads when there are fewer KV heads than ranks)."""
        cfg = self.config
        heads = max(1, cfg.num_key_value_heads // group().size)
        return KVSpec(self.num_attention_layers, heads, cfg.head_dim, self.dtype)

    def state_spec(self) -> StateSpec:
        """State pool shape: the state components of each recurrent mixer, in model order."""
        mixers = (layer.recurrent_mixer() for layer in self.stack.layers)
        return StateSpec(tuple(m.state_components() for m in mixers if m is not None))

    def forward(self, batch: ForwardBatch, kv: KVPool, state: StatePool) -> torch.Tensor:
        """Logits [B, vocab] (float32) of each sequence's last new token (or of the rows
        `batch.logit_rows` names, when set); updates the pools.

        Runs under `torch.inference_mode()` itself, so callers need not.
        """
        check_batch(batch, kv, state, self.num_attention_layers, self.num_recurrent_layers)
        with torch.inference_mode():
            h = self.run_layers(self.embed(batch.input_ids), batch, kv, state)
            if batch.logit_rows is not None:
                last = h.index_select(0, batch.logit_rows.to(h.device))
            elif batch.mode == "decode":
                last = h  # one new token per sequence: every row is a last token (and no host tensor to copy)
            else:
                last = h.index_select(0, batch.last_token_index.to(h.device))
            with threads_for(batch.head_threads):
                return self.logits(last)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.stack.embedding()(input_ids)

    def run_layers(self, h: torch.Tensor, batch: ForwardBatch, kv: KVPool, state: StatePool) -> torch.Tensor:
        for layer in self.stack.layers:
            h = layer.step(h, batch, kv, state)
        return h

    def logits(self, last: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the last tokens' hidden states [B, hidden]."""
        return self.lm_head(self.stack.final_norm()(last))

    def resolve_weight(self, hf_name: str) -> WeightTarget | None:
        """The parameter a checkpoint entry loads into; None for entries the model does not use."""
        if hf_name == "lm_head.weight" and self.lm_head.is_tied:
            return None
        if hf_name.startswith(self.skipped_prefixes) or hf_name.endswith(self.skipped_suffixes):
            return None
        row = stacked_row(hf_name) if self.merges_expert_weights else None
        return row or self.rename_weight(hf_name)

    def rename_weight(self, hf_name: str) -> WeightTarget:
        """The parameter for a used checkpoint name: the same name unless the family renames it."""
        return WeightTarget(hf_name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; raises ValueError naming missing or unexpected weights."""
        if self.merges_expert_weights:
            weights = merge_expert_weights(weights)
        load_named_weights(self, weights, self.resolve_weight)
