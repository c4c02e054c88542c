"""Per-expert MoE checkpoint tensors -> rows of the stacked expert parameters.

transformers 5 keeps experts stacked in memory (`experts.gate_up_proj` [E, 2I, H], gate rows
first; `experts.down_proj` [E, H, I]) but `save_pretrained` writes them per expert
(`experts.<e>.gate_proj.weight`, `up_proj`, `down_proj`), as the published Qwen3-Next and Jamba
checkpoints are. Both layouts load.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from himamba.services.worker.models.weight_loading import WeightTarget

_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
# The name under which a merged gate+up row travels to `resolve_stacked` (never a checkpoint name).
_ROW = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)\[(?P<expert>\d+)\]$")


def merge_expert_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass tensors through, turning per-expert gate/up pairs into one `gate_up_proj[e]` row each and
    per-expert down matrices into `down_proj[e]` rows; ValueError names an unpaired gate or up."""
    pending: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        match = _PER_EXPERT.match(name)
        if match is None:
            yield name, tensor
            continue
        prefix, expert, proj = match["prefix"], int(match["expert"]), match["proj"]
        if proj == "down_proj":
            yield f"{prefix}.down_proj[{expert}]", tensor
            continue
        halves = pending.setdefault((prefix, expert), {})
        halves[proj] = tensor
        if len(halves) == 2:
            del pending[(prefix, expert)]
            yield f"{prefix}.gate_up_proj[{expert}]", torch.cat((halves["gate_proj"], halves["up_proj"]))
    if pending:
        missing = sorted(
            f"{prefix}.{expert}.{'up_proj' if 'gate_proj' in halves else 'gate_proj'}.weight"
            for (prefix, expert), halves in pending.items()
        )
        raise ValueError(f"missing weights: {', '.join(missing)}")


def stacked_row(name: str) -> WeightTarget | None:
    """The stacked-parameter row a name from `merge_expert_weights` goes to (None: not such a name)."""
    match = _ROW.match(name)
    if match is None:
        return None
    return WeightTarget(f"{match['prefix']}.{match['proj']}", int(match["expert"]))
