"""Copying checkpoint tensors into a model's parameters by name, with strict accounting."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
from torch import nn

from himamba.services.worker.tensor_parallel import group

_LISTED_NAMES = 8


class WeightTarget(NamedTuple):
    """Where one checkpoint tensor goes: a parameter, or one row of a stacked parameter.

    `index` is set when the checkpoint stores per-expert matrices that the model stacks into a
    single [E, ...] parameter (older HF layouts such as `experts.3.up_proj.weight`).
    """

    name: str
    index: int | None = None


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_LISTED_NAMES])
    more = len(names) - _LISTED_NAMES
    return shown + (f" (and {more} more)" if more > 0 else "")


def load_named_weights(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    resolve: Callable[[str], WeightTarget | None],
    optional: frozenset[str] = frozenset(),
) -> frozenset[str]:
    """Copy each (checkpoint name, tensor) into `module`'s parameter `resolve(name)`.

    `resolve` returns None for checkpoint entries the model deliberately does not use (e.g.
    multi-token-prediction heads). Tensors are cast to the parameter's dtype and device.
    Raises ValueError naming the missing parameters, the unexpected checkpoint names and any
    shape mismatch; every parameter must be loaded exactly (stacked ones: every row) except those
    in `optional`. Returns the names of the parameters that were loaded. A parameter marked with a
    tensor-parallel shard (tensor_parallel.mark) takes its rank's share of the full tensor.
    """
    params = dict(module.named_parameters())
    whole: set[str] = set()
    rows: dict[str, set[int]] = {}
    unexpected: list[str] = []
    mismatched: list[str] = []
    with torch.no_grad():
        for hf_name, tensor in weights:
            target = resolve(hf_name)
            if target is None:
                continue
            param = params.get(target.name)
            if param is None:
                unexpected.append(hf_name)
                continue
            if target.index is None:
                dest = param
            else:
                if not 0 <= target.index < param.shape[0]:
                    unexpected.append(hf_name)
                    continue
                dest = param[target.index]
            shard = getattr(param, "tp_shard", None)
            if shard is not None:  # the shard is of the whole (stacked) parameter: give a row its leading dim
                tensor = shard(tensor, group()) if target.index is None else shard(tensor.unsqueeze(0), group())[0]
            if tuple(tensor.shape) != tuple(dest.shape):
                mismatched.append(f"{hf_name}: checkpoint {tuple(tensor.shape)} vs model {tuple(dest.shape)}")
                continue
            dest.copy_(tensor)
            if target.index is None:
                whole.add(target.name)
            else:
                rows.setdefault(target.name, set()).add(target.index)
    loaded = frozenset(
        name for name, param in params.items() if name in whole or len(rows.get(name, ())) == param.shape[0]
    )
    missing = [name for name in params if name not in loaded and name not in optional]
    problems = []
    if mismatched:
        problems.append(f"weights with the wrong shape: {_listing(mismatched)}")
    if missing:
        problems.append(f"missing weights: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected weights: {_listing(unexpected)}")
    if problems:
        raise ValueError("; ".join(problems))
    return loaded
